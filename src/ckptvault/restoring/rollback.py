"""An allowed rollback, told: what it went back from, in the log, the audit log and
``RestoreInfo``.

``restore(state, allow_rollback_to=STEP)`` with a ledger lowers the floor to STEP
and abandons every newer generation made before it (:mod:`ckptvault.trust.ledger`).
That is a decision about the run, so it is never quiet: a WARNING names the step it
went back from, the ``Restored`` event carries a :class:`RollbackApplied` (the
ledger keeps its rule, the audit log writes a ``rollback_allowed`` entry) and
``RestoreInfo.rolled_back_from`` says it. "From" is the highest of the previous
restore floor and the newest generation above STEP that passed the checks needing
no tensor byte (``Selection.passed_over``): what the run would otherwise resume.
"""

from __future__ import annotations

import logging

from ckptvault.events import RollbackApplied
from ckptvault.restoring.selector import Selection
from ckptvault.storage.base import GenerationRef
from ckptvault.trust.ledger import rollback_cutoff

logger = logging.getLogger("ckptvault")


def allowed_rollback(
    selection: Selection, ref: GenerationRef, has_ledger: bool
) -> RollbackApplied | None:
    """The rollback ``ref``'s restore applies, or None (no ``allow_rollback_to``, or
    no ledger: without one a rollback is an ordinary restore of an older step)."""
    if selection.rollback_to is None or not has_ledger:
        return None
    previous = selection.previous_floor
    previous_step = previous.step if previous is not None else None
    seen = [g.step for g in selection.passed_over]
    above = [s for s in (previous_step, *seen) if s is not None and s > ref.step]
    return RollbackApplied(
        previous_floor=previous_step,
        abandoned=[(g.generation_id, g.step) for g in selection.listed if g.step > ref.step],
        cutoff_generation_id=rollback_cutoff(previous, ref.generation_id, selection.published),
        from_step=max(above, default=None),
    )


def warn_rollback(rollback: RollbackApplied, ref: GenerationRef, run_id: str) -> None:
    """One loud line: a rollback is a decision about the run, never a detail."""
    came_from = (
        f"from step {rollback.from_step}"
        if rollback.from_step is not None
        else "(no newer generation verified)"
    )
    logger.warning(
        "run %r rolled back on purpose %s to step %d (generation %s, allow_rollback_to): "
        "the restore floor is now step %d and every newer generation made before now is "
        "abandoned (recorded in the ledger and the audit log)",
        run_id,
        came_from,
        ref.step,
        ref.generation_id,
        ref.step,
    )
