"""Object Lock and retention: which generations are locked, and GC keeping them.

Two decisions live here, both about stores that can hold objects under retention
(:class:`~ckptvault.storage.retained.RetainingStore`; S3 with Object Lock):

- **Which generations publish locks** (``object_lock_days``): the milestones of the
  retention policy that governs the store (steps that are multiples of
  ``keep_every``), because those are the generations kept for ever; without any
  retention policy nothing is ever deleted, so every generation is. A generation
  pinned later is locked when it is pinned (:func:`ckptvault.retention.marks.pin`).
  The manager installs the rule on each tier's store once (:func:`install_lock_rule`);
  the store's publish rule asks it with the step of each generation it publishes,
  whether written by a save or copied by replication.
- **Retention keeps what it may not delete** (:func:`keep_locked`): before a plan is
  applied, every generation it would mark or delete is looked up in each store that
  can hold retention; one under Object Lock (or a legal hold) is kept, whole and
  restorable, with the reason ``locked until <date>``, instead of being half
  deleted or failing. Once the date has passed, the rules decide again. A mark whose
  generation the planned store no longer lists (an orphan) is looked up in the one
  tier that carries it, and stays (the deletion waits) while that tier's copy is
  locked.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from ckptvault.errors import CheckpointError
from ckptvault.format.layout import GenerationName
from ckptvault.retention.plan import DELETE, KEEP, MARK, MARKED, UNMARK, Decision, RetentionPlan
from ckptvault.retention.policy import Retention
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.storage.retained import LockRule, RetainingStore

logger = logging.getLogger("ckptvault")


def lock_rule(retention: Retention | None) -> LockRule:
    """Which steps' generations ``object_lock_days`` locks at publish (see the module)."""
    if retention is None:
        return _every_step
    every = retention.keep_every
    if every is None:
        return _no_step
    return lambda step: step % every == 0


def _every_step(step: int) -> bool:
    return True


def _no_step(step: int) -> bool:
    return False


def install_lock_rule(store: Store, retention: Retention | None) -> None:
    """Tell ``store`` (when it can lock objects) which generations to lock at publish."""
    if isinstance(store, RetainingStore):
        store.set_lock_rule(lock_rule(retention))


def keep_locked(plan: RetentionPlan, stores: Sequence[Store]) -> RetentionPlan:
    """``plan`` with every generation it would mark or delete, and that a store holds
    under retention, kept instead (unmarked when it was marked)."""
    if not any(isinstance(store, RetainingStore) for store in stores):
        return plan
    listings: dict[int, dict[GenerationName, GenerationRef]] = {}
    decisions = []
    for decision in plan.decisions:
        going = decision.action in (MARK, DELETE)
        tiers = [
            store if not decision.only_in or store.location in decision.only_in else None
            for store in stores
        ]
        hold = _hold_of(decision.name, tiers, listings) if going else None
        if hold is None:
            decisions.append(decision)
        elif decision.listed:
            decisions.append(_kept(decision, hold))
        else:  # an orphan: nothing plans it again, so its mark stays and waits
            reasons = (decision.reasons[0], hold)
            decisions.append(replace(decision, action=MARKED, reasons=reasons))
    return replace(plan, decisions=decisions)


def _hold_of(
    name: GenerationName,
    stores: Sequence[Store | None],
    listings: dict[int, dict[GenerationName, GenerationRef]],
) -> str | None:
    """Why a store may not delete this generation now; None when every store may
    (None stands for a store the decision does not touch)."""
    for index, store in enumerate(stores):
        if not isinstance(store, RetainingStore):
            continue
        if index not in listings:
            listings[index] = {ref.name: ref for ref in store.list_generations()}
        ref = listings[index].get(name)
        if ref is None:
            continue
        try:
            hold = store.retained_until(ref)
        except (OSError, CheckpointError) as exc:
            # Unknown is not "free to delete": keep it, and ask again next pass.
            return f"its Object Lock retention in {store.location} could not be read ({exc})"
        if hold is not None:
            return hold if len(stores) == 1 else f"{hold} in {store.location}"
    return None


def _kept(decision: Decision, hold: str) -> Decision:
    action = UNMARK if decision.was_marked else KEEP
    return replace(decision, action=action, reasons=(hold,), marked_at=None, delete_after=None)
