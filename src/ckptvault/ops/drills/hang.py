"""The hang drill: a supervised job that deadlocks is found, killed and restarted,
and the new attempt resumes from the last generation the hung one saved.

``ckptvault supervise --hang-timeout 2 --max-restarts 1`` runs the drills' tiny
training script (:mod:`~ckptvault.ops.drills.worker`, ``train --fail hang``) on a
scratch run of its own. Attempt 1 saves two steps (each save reports progress) and
then deadlocks: two threads that take two locks in opposite orders. Measured from the
script's marks and the supervisor's attempt log: ``detection`` (the deadlock to the
hung attempt's end: the hang timeout, SIGTERM and the exit), ``launch``, ``restore``,
``first_step`` and ``recovery`` (the deadlock to the resumed run's first step).
"""

from __future__ import annotations

from ckptvault.ops.drills.base import Drill
from ckptvault.ops.drills.context import DrillContext
from ckptvault.ops.drills.supervised import run_supervised

Outcome = tuple[bool, str, dict[str, float]]
HANG_TIMEOUT_S = 2.0  # the drill's job reports progress at every save, twice a second at most


def _hang_drill(context: DrillContext) -> Outcome:
    options = ["--grace-seconds", "2", "--no-catalog", "--hang-timeout", f"{HANG_TIMEOUT_S:g}"]
    run = run_supervised(context, "hang-watchdog", "hang", options)
    passed = run.resumed_after_one_failure() and run.first_attempt("kind") == "hang"
    failed_at = run.failed_at
    observed = (
        f"supervise exited {run.returncode} after {len(run.attempts)} attempt(s); attempt 1 "
        f"deadlocked after saving step {failed_at[0] if failed_at else '?'} and ended as "
        f"{run.first_attempt('kind')} ({run.first_attempt('signal')}); {run.describe_resume()}"
    )
    return passed, observed, run.timings() if passed else {}


HANG_DRILLS = [
    Drill(
        "hang-watchdog",
        f"ckptvault supervise --hang-timeout {HANG_TIMEOUT_S:g} kills the deadlocked job, "
        "records a hang and restarts it; it resumes from its last save",
        _hang_drill,
    ),
]
