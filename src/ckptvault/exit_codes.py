"""Process exit codes a training job and ``ckptvault supervise`` agree on.

A job that uses ckptvault exits with one of these so that a supervisor (``ckptvault
supervise``, or a scheduler's own retry policy) knows what to do next without
parsing logs. Values follow BSD ``sysexits.h`` where one fits.
"""

from __future__ import annotations

SUCCESS = 0
# The job saved a final checkpoint after a preemption signal (SIGTERM from the
# scheduler) and stopped on purpose: start it again, it resumes from that save.
# EX_TEMPFAIL: "try again later". Does not count against the restart budget.
PREEMPTED = 75
# The job cannot succeed by being started again: the checkpoint's run contract does
# not match the code or config (ContractMismatch), the state does not fit
# (StateMismatchError), or a usage error. EX_CONFIG. A supervisor stops at once.
PERMANENT_FAILURE = 78

PERMANENT = frozenset({PERMANENT_FAILURE})
