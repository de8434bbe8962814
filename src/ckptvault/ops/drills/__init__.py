"""Recovery drills: make each failure happen, for real, on a copy, and time the recovery.

``ckptvault drill STORE`` copies the newest generations of a store (read only) into a
scratch directory and runs every scenario there; ``ckptvault drill --synthetic``
builds a small signed, encrypted run of its own. Each :class:`Drill` states its
expected outcome, checks it and reports a :class:`DrillResult` with its timings
(discovery, verification, read, apply, recovery). The modules:

- :mod:`~ckptvault.ops.drills.base`: ``Drill``, ``DrillResult``, a timed restore;
- :mod:`~ckptvault.ops.drills.context`: the scratch copy and its managers;
- :mod:`~ckptvault.ops.drills.damage`: truncated, flipped, missing, pickle, other
  run, format version;
- :mod:`~ckptvault.ops.drills.trust_drills`: rollback, key destroyed, remote tier;
- :mod:`~ckptvault.ops.drills.storage`: storage full, slow storage;
- :mod:`~ckptvault.ops.drills.crash`: SIGKILL mid-save, supervised restart (with
  :mod:`~ckptvault.ops.drills.worker`, the child processes);
- :mod:`~ckptvault.ops.drills.hang`: a deadlocked job under the hang watchdog;
- :mod:`~ckptvault.ops.drills.runner`: choosing and running them.
"""

from ckptvault.ops.drills.base import Drill, DrillResult, DrillSkipped
from ckptvault.ops.drills.context import DrillContext, context_from_store, synthetic_context
from ckptvault.ops.drills.runner import ALL_DRILLS, DRILL_NAMES, choose_drills, run_drills

__all__ = [
    "ALL_DRILLS",
    "DRILL_NAMES",
    "Drill",
    "DrillContext",
    "DrillResult",
    "DrillSkipped",
    "choose_drills",
    "context_from_store",
    "run_drills",
    "synthetic_context",
]
