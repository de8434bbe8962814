"""A process's first save of many small tensors, against torch.save + fsync (issue 27,
item 4).

    python -m bench.first_save [--count 10000] [--reps 5] [--dir bench-out/first-save]
                               [--tmpfs]

Every measurement is a fresh interpreter (the state built, then one save timed), as
a job that has just started or restarted pays it: no import, cache or warm
allocator is carried from a measurement before. The contenders alternate, their
order rotated each round:

- ``torch.save+fsync``: the flat dict of ``count`` tensors of 256 float32
  (:func:`bench.scale_tensors.flat_state`) pickled into one file, fsync'd;
- ``ckptvault first save``: a manager opened (untimed), then its first ``save`` of
  the same dict timed, with what it spends capturing the state, laying the tensors
  out and planning the indexes (wrappers around those functions); then a second
  save of the same layout, for reference.

Prints the medians and best runs, the paired ratio and the goal (first save at most
1.2x torch.save + fsync), and writes ``--out``/first_save.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.measure import rotated

GOAL = 1.2
CONTENDERS = ("torch.save+fsync", "ckptvault first save")

_CHILD = r"""
import json, os, sys, time
import torch
from bench.scale_tensors import flat_state

contender, count, where = sys.argv[1], int(sys.argv[2]), sys.argv[3]
state = flat_state(count, 0)
out = {}
if contender == "torch.save+fsync":
    started = time.perf_counter()
    with open(os.path.join(where, "state.pt"), "wb") as handle:
        torch.save(state, handle)
        handle.flush()
        os.fsync(handle.fileno())
    out["seconds"] = time.perf_counter() - started
else:
    import ckptvault as cv
    from ckptvault import manager as manager_module
    from ckptvault.io import direct_write
    from ckptvault.saving import indexes

    spent = {"capture": 0.0, "layout": 0.0, "index planning": 0.0}  # layout: with its plan

    def timed(owner, name, stage):
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent[stage] += time.perf_counter() - started

        setattr(owner, name, wrapper)

    timed(manager_module.CheckpointManager, "_capture", "capture")
    timed(direct_write, "plan_layout", "layout")
    timed(indexes, "plan_indexes", "index planning")  # from a dcp section
    timed(direct_write, "whole_tensors_plan", "index planning")  # inside the layout
    mgr = cv.CheckpointManager(os.path.join(where, "store"), run_id="first-save")
    started = time.perf_counter()
    handle = mgr.save(1, state)
    out["seconds"] = time.perf_counter() - started
    spent["layout"] -= spent["index planning"]  # the layout's own plan is counted there
    out["parts"] = dict(spent)
    started = time.perf_counter()
    mgr.save(2, state)
    out["second"] = time.perf_counter() - started
    mgr.close()
print("RESULT " + json.dumps(out))
"""


def run_one(contender: str, count: int, where: Path) -> dict[str, Any]:
    """One fresh interpreter measuring ``contender`` once."""
    shutil.rmtree(where, ignore_errors=True)
    where.mkdir(parents=True)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": f"{repo}{os.pathsep}{repo / 'src'}"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, contender, str(count), str(where)],
        capture_output=True,
        text=True,
        env=env,
        cwd=repo,
        check=False,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{contender} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    shutil.rmtree(where, ignore_errors=True)
    return result


def measure(count: int, reps: int, where: Path) -> dict[str, list[dict[str, Any]]]:
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTENDERS}
    for _ in range(reps):
        for name in rotated(list(CONTENDERS)):
            runs[name].append(run_one(name, count, where / "work"))
    return runs


def render(runs: dict[str, list[dict[str, Any]]], count: int, where: Path) -> str:
    theirs = [r["seconds"] for r in runs[CONTENDERS[0]]]
    ours = [r["seconds"] for r in runs[CONTENDERS[1]]]
    ratios = [a / b for a, b in zip(ours, theirs, strict=True)]  # paired by round
    best = min(ours) / min(theirs)
    lines = [
        f"A fresh process's first save of {count:,} tensors of 256 float32 ({len(ours)} "
        f"rounds, each a new interpreter, order rotated; {where}):",
        "",
        "| contender | median s | best s |",
        "|---|---:|---:|",
    ]
    for name in CONTENDERS:
        seconds = [r["seconds"] for r in runs[name]]
        lines.append(f"| {name} | {statistics.median(seconds):.3f} | {min(seconds):.3f} |")
    seconds = [r["second"] for r in runs[CONTENDERS[1]]]
    lines.append(
        f"| ckptvault second save (same process) | {statistics.median(seconds):.3f} | "
        f"{min(seconds):.3f} |"
    )
    met = best <= GOAL
    lines += [
        "",
        f"**first save / torch.save+fsync: {best:.2f}x by best runs, "
        f"{statistics.median(ratios):.2f}x median of paired rounds; goal <= {GOAL}x: "
        f"{'met' if met else 'not met'}.**",
        "",
        "Inside ckptvault's first save (median s): "
        + ", ".join(
            f"{part} {statistics.median(r['parts'][part] for r in runs[CONTENDERS[1]]):.3f}"
            for part in runs[CONTENDERS[1]][0]["parts"]
        ),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--count", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("bench-out/first-save"))
    parser.add_argument("--tmpfs", action="store_true", help="measure in /dev/shm instead")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    where = Path(f"/dev/shm/ckptvault-first-save-{os.getpid()}") if args.tmpfs else args.dir
    try:
        runs = measure(args.count, args.reps, where)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    text = render(runs, args.count, where)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_save.md").write_text(text + "\n")
    (args.out / "first_save.json").write_text(json.dumps(runs, indent=1))
    return text


if __name__ == "__main__":
    main()
