"""The hang drill: a supervised job that deadlocks is found, killed and restarted,
and the new attempt resumes from the last generation the hung one saved.

``ckptvault supervise --hang-timeout 2 --max-restarts 1`` runs the drills' tiny
training script (:mod:`~ckptvault.ops.drills.worker`, ``train --fail hang``) on a
scratch run of its own. Attempt 1 saves two steps (each save reports progress) and
then deadlocks: two threads that take two locks in opposite orders. Measured from the
script's marks and the supervisor's attempt log: ``detection`` (the deadlock to the
hung attempt's end: the hang timeout, SIGTERM and the exit), ``restore`` and
``recovery`` (the deadlock to the resumed run's first step).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

from ckptvault.ops.drills.base import STAGE_KEYS, Drill
from ckptvault.ops.drills.context import DrillContext
from ckptvault.ops.drills.crash import CHILD_TIMEOUT_S, WORKER, read_lines

Outcome = tuple[bool, str, dict[str, float]]
HANG_TIMEOUT_S = 2.0  # the drill's job reports progress at every save, twice a second at most


def _timings(marks: list[dict[str, Any]], attempts: list[dict[str, Any]]) -> dict[str, float]:
    def at(mark: str, attempt: int) -> float:
        return float(next(m["at"] for m in marks if m["mark"] == mark and m["attempt"] == attempt))

    hung = at("failing", 1)
    restored = next(m for m in marks if m["mark"] == "restored" and m["attempt"] == 2)
    timings = {
        "detection": attempts[0]["ended_at"] - hung,
        "restore": restored["at"] - at("imported", 2),
        "recovery": at("step", 2) - hung,
    }
    for stage, seconds in restored["stages"].items():
        if stage in STAGE_KEYS:
            timings[stage] = seconds
    return timings


def _hang_drill(context: DrillContext) -> Outcome:
    work = context.workdir("hang-watchdog")
    marks, log = work / "marks.jsonl", work / "attempts.jsonl"
    script = [*WORKER, "train", str(work / "store"), str(marks), "--run-id", "drill-hang"]
    script += ["--ledger", str(work / "ledger.sqlite3"), "--fail", "hang"]
    command = [sys.executable, "-m", "ckptvault", "supervise", "--max-restarts", "1"]
    command += ["--backoff", "0", "--grace-seconds", "2", "--no-catalog", "--log", str(log)]
    command += ["--hang-timeout", f"{HANG_TIMEOUT_S:g}", "--", *script]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=2 * CHILD_TIMEOUT_S, check=False
    )
    attempts = [r for r in read_lines(log) if r.get("event") == "attempt"]
    got = read_lines(marks)
    restored = [m for m in got if m["mark"] == "restored"]
    hung_at = [m["step"] for m in got if m["mark"] == "failing"]
    passed = (
        result.returncode == 0
        and len(attempts) == 2
        and attempts[0].get("kind") == "hang"
        and len(restored) == 2
        and hung_at != []
        and restored[1]["step"] == hung_at[0]
        and any(m["mark"] == "done" for m in got)
    )
    observed = (
        f"supervise exited {result.returncode} after {len(attempts)} attempt(s); attempt 1 "
        f"deadlocked after saving step {hung_at[0] if hung_at else '?'} and ended as "
        f"{attempts[0].get('kind') if attempts else '?'} "
        f"({attempts[0].get('signal') if attempts else '?'}); attempt 2 restored step "
        f"{restored[1]['step'] if len(restored) > 1 else '?'}"
    )
    return passed, observed, _timings(got, attempts) if passed else {}


HANG_DRILLS = [
    Drill(
        "hang-watchdog",
        f"ckptvault supervise --hang-timeout {HANG_TIMEOUT_S:g} kills the deadlocked job, "
        "records a hang and restarts it; it resumes from its last save",
        _hang_drill,
    ),
]
