"""Drills that run the drills' tiny training script under ``ckptvault supervise``.

The script (:mod:`~ckptvault.ops.drills.worker`, ``train``) saves a few steps, then
fails its first attempt (``--fail kill``: SIGKILLs itself; ``--fail hang``: deadlocks)
and marks each milestone (``imported``, ``restored``, ``step``, ``failing``, ``done``)
as one JSON line. A drill passes when the supervisor ran exactly two attempts, the
second restored the step the first had saved last before failing, and trained on to
the end. The timings come from those marks and the supervisor's attempt log.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptvault.ops.drills.base import STAGE_KEYS
from ckptvault.ops.drills.context import DrillContext

WORKER = [sys.executable, "-m", "ckptvault.ops.drills.worker"]
CHILD_TIMEOUT_S = 120.0


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class SupervisedRun:
    """What one supervised run of the script left: the supervisor's exit status, its
    attempt records and the script's marks."""

    returncode: int
    attempts: list[dict[str, Any]]
    marks: list[dict[str, Any]]

    @property
    def restored(self) -> list[dict[str, Any]]:
        return [m for m in self.marks if m["mark"] == "restored"]

    @property
    def failed_at(self) -> list[int]:
        return [m["step"] for m in self.marks if m["mark"] == "failing"]

    def resumed_after_one_failure(self) -> bool:
        """Two attempts; the second restored the step the first saved last, and
        finished."""
        restored, failed_at = self.restored, self.failed_at
        return (
            self.returncode == 0
            and len(self.attempts) == 2
            and len(restored) == 2
            and failed_at != []
            and restored[1]["step"] == failed_at[0]
            and any(m["mark"] == "done" for m in self.marks)
        )

    def first_attempt(self, field: str) -> str:
        return str(self.attempts[0].get(field)) if self.attempts else "?"

    def describe_resume(self) -> str:
        restored = self.restored
        return f"attempt 2 restored step {restored[1]['step'] if len(restored) > 1 else '?'}"

    def timings(self) -> dict[str, float]:
        """``detection`` (the failure to the failed attempt's end), ``launch``,
        ``restore``, ``first_step`` and ``recovery`` (the failure to the resumed run's
        first step), and the restore's own stages."""

        def at(mark: str, attempt: int) -> float:
            return float(
                next(m["at"] for m in self.marks if m["mark"] == mark and m["attempt"] == attempt)
            )

        failing, restarted = at("failing", 1), self.attempts[1]["started_at"]
        restored = next(m for m in self.marks if m["mark"] == "restored" and m["attempt"] == 2)
        timings = {
            "detection": self.attempts[0]["ended_at"] - failing,
            "launch": at("imported", 2) - restarted,
            "restore": restored["at"] - at("imported", 2),
            "first_step": at("step", 2) - restored["at"],
            "recovery": at("step", 2) - failing,
        }
        for stage, seconds in restored["stages"].items():
            if stage in STAGE_KEYS:
                timings[stage] = seconds
        return timings


def run_supervised(
    context: DrillContext, name: str, fail: str, supervise_options: list[str]
) -> SupervisedRun:
    """Run the script (failing its first attempt as ``fail`` says) under ``ckptvault
    supervise --max-restarts 1 --backoff 0`` plus ``supervise_options``, in the drill's
    own scratch directory ``name``."""
    work = context.workdir(name)
    marks, log = work / "marks.jsonl", work / "attempts.jsonl"
    script = [*WORKER, "train", str(work / "store"), str(marks), "--run-id", f"drill-{name}"]
    script += ["--ledger", str(work / "ledger.sqlite3"), "--fail", fail]
    command = [sys.executable, "-m", "ckptvault", "supervise", "--max-restarts", "1"]
    command += ["--backoff", "0", "--log", str(log), *supervise_options, "--", *script]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=2 * CHILD_TIMEOUT_S, check=False
    )
    attempts = [r for r in read_lines(log) if r.get("event") == "attempt"]
    return SupervisedRun(result.returncode, attempts, read_lines(marks))
