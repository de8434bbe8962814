"""Print the reliability table from a log written by ``tests/support/reliability.py``.

    python tests/support/reliability_table.py .reliability.jsonl

Rows with the same scenario are summed (a scenario may be recorded by several
parametrized cases). Exits 1 when any scenario has a failure or the log is empty, so
``make reliability`` fails loudly rather than printing a reassuring table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load(path: Path) -> dict[str, list[int]]:
    totals: dict[str, list[int]] = {}
    if not path.exists():
        return totals
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        trials, failures = totals.setdefault(row["scenario"], [0, 0])
        totals[row["scenario"]] = [trials + row["trials"], failures + row["failures"]]
    return totals


def render(totals: dict[str, list[int]]) -> str:
    width = max([len("scenario"), *(len(name) for name in totals)])
    lines = [
        f"| {'scenario':<{width}} | {'trials':>8} | {'failures':>8} |",
        f"|{'-' * (width + 2)}|{'-' * 9}:|{'-' * 9}:|",
    ]
    for name, (trials, failures) in totals.items():
        lines.append(f"| {name:<{width}} | {trials:>8,} | {failures:>8,} |")
    all_trials = sum(t for t, _ in totals.values())
    all_failures = sum(f for _, f in totals.values())
    lines.append(f"| {'**total**':<{width}} | {all_trials:>8,} | {all_failures:>8,} |")
    return "\n".join(lines)


def main() -> int:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else ".reliability.jsonl")
    totals = load(path)
    if not totals:
        print(f"no reliability figures in {path}: did the tests run?", file=sys.stderr)
        return 1
    print(render(totals))
    return 1 if any(failures for _, failures in totals.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
