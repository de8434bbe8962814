"""Applying a retention plan to every store (tier) that holds the run.

The plan is made from the first store; its marks, unmarks and deletions reach every
store in ``stores``. A deletion goes in this order: the mark exists in every store
(written now when the delay is 0); the leases in every store are read once more (a
reader may have started since the plan was made); the generation is deleted from
every store that lists it; only then are the marks removed. So an interrupted or
partly failed deletion leaves a mark behind, and the next pass finishes it: a mark
whose generation is gone from the first store is an "orphan", and the planner
finishes each tier's orphan in that tier alone (``Decision.only_in``), so a mark
planted in one tier never deletes another tier's copy.

Each mark, unmark and deletion is told to the event subscribers (the audit log
records ``mark``, ``unmark`` and ``delete`` entries). A failure on one generation is
logged and reported, and the rest of the plan still runs; an audit failure stops it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ckptvault.errors import AuditError, CheckpointError, UsageError
from ckptvault.events import Deleted, Event, Marked, Unmarked
from ckptvault.format.layout import GenerationName, format_timestamp
from ckptvault.progress import Meter, Progress
from ckptvault.retention.marks import put_mark, read_leases, remove_mark, stale_leases
from ckptvault.retention.plan import DELETE, MARK, UNMARK, Decision, RetentionPlan
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.storage.records import LEASE
from ckptvault.storage.retained import RetainedCopy, RetainingStore

logger = logging.getLogger("ckptvault")


@dataclass
class AppliedPlan:
    """What applying a plan did."""

    marked: list[Decision] = field(default_factory=list)
    unmarked: list[Decision] = field(default_factory=list)
    deleted: list[Decision] = field(default_factory=list)
    deferred: list[tuple[Decision, str]] = field(default_factory=list)  # a lease appeared
    failed: list[tuple[Decision, str]] = field(default_factory=list)
    # Copies a store was not allowed to delete (Object Lock on versions): the mark stays,
    # and later passes try again.
    retained: list[tuple[Decision, list[RetainedCopy]]] = field(default_factory=list)

    def outcome(self, decision: Decision) -> str:
        """``marked``, ``unmarked``, ``deleted``, ``deleted; N copies retained (...)``,
        ``retained: ...``, ``deferred: ...``, ``failed: ...`` or ``""``."""
        for done, copies in self.retained:
            if done == decision:
                kept = f"{len(copies)} {'copy' if len(copies) == 1 else 'copies'} retained"
                why = f"{kept} ({copies[0].reason})"
                return f"deleted; {why}" if decision.listed else f"retained: {why}"
        for label, decisions in (
            ("marked", self.marked),
            ("unmarked", self.unmarked),
            ("deleted", self.deleted),
        ):
            if decision in decisions:
                return label
        for label, pairs in (("deferred", self.deferred), ("failed", self.failed)):
            for done, why in pairs:
                if done == decision:
                    return f"{label}: {why}"
        return ""

    def retained_json(self) -> list[dict[str, Any]]:
        """Every retained copy, with its generation (for reports such as ``gc --json``)."""
        return [
            {"step": d.step, "generation_id": d.generation_id, **copy.to_json()}
            for d, copies in self.retained
            for copy in copies
        ]


class PlanApplier:
    def __init__(
        self,
        stores: Sequence[Store],
        emit: Callable[[Event], None],
        run_id: str | None = None,
    ) -> None:
        if not stores:
            raise UsageError("retention needs at least one store")
        self.stores = list(stores)
        self.emit = emit
        self.run_id = run_id

    def apply(self, plan: RetentionPlan, progress: Progress | None = None) -> AppliedPlan:
        """Carry out every mark, unmark and deletion of ``plan``; ``progress(done,
        total)`` counts those decisions as each is done (failed ones too)."""
        result = AppliedPlan()
        listings: dict[int, dict[GenerationName, GenerationRef]] = {}
        work = [d for d in plan.decisions if d.action in (MARK, UNMARK, DELETE)]
        meter = Meter(progress, len(work))
        for decision in work:
            try:
                self._apply_one(decision, plan.now, listings, result)
            except AuditError:
                raise
            except (OSError, CheckpointError) as exc:
                logger.error(
                    "retention could not %s generation %s (step %d): %s; the next pass retries",
                    decision.action,
                    decision.generation_id,
                    decision.step,
                    exc,
                )
                result.failed.append((decision, str(exc)))
            meter(1)  # outside the handlers: a failing callback is never a failed deletion
        self._drop_expired_leases()
        return result

    def _apply_one(
        self,
        decision: Decision,
        now: datetime,
        listings: dict[int, dict[GenerationName, GenerationRef]],
        result: AppliedPlan,
    ) -> None:
        """Mark, unmark or delete, and file the outcome under ``result``."""
        if decision.action == MARK:
            self._mark(decision, now)
            result.marked.append(decision)
        elif decision.action == UNMARK:
            self._unmark(decision)
            result.unmarked.append(decision)
        else:
            waiting, retained = self._delete(decision, now, listings)
            if waiting:
                result.deferred.append((decision, waiting))
                return
            if retained:
                result.retained.append((decision, retained))
            if decision.listed or not retained:
                result.deleted.append(decision)

    def _tiers(self, decision: Decision) -> list[Store]:
        """The stores ``decision`` applies to: every one, or an orphan's own tier."""
        if not decision.only_in:
            return self.stores
        return [store for store in self.stores if store.location in decision.only_in]

    def _where(self, decision: Decision) -> str:
        return decision.only_in[0] if decision.only_in else self.stores[0].location

    def _mark(self, decision: Decision, now: datetime) -> None:
        marked_at = decision.marked_at or now
        put_mark(self._tiers(decision), decision.name, decision.reason, marked_at)
        self.emit(
            Marked(
                self.run_id,
                self._where(decision),
                decision.step,
                decision.generation_id,
                decision.reason,
                format_timestamp(marked_at),
            )
        )

    def _unmark(self, decision: Decision) -> None:
        remove_mark(self._tiers(decision), decision.name)
        self.emit(
            Unmarked(
                self.run_id,
                self._where(decision),
                decision.step,
                decision.generation_id,
                f"kept again: {decision.reason}",
            )
        )

    def _delete(
        self,
        decision: Decision,
        now: datetime,
        listings: dict[int, dict[GenerationName, GenerationRef]],
    ) -> tuple[str | None, list[RetainedCopy]]:
        """Delete everywhere; returns why it must wait instead (a fresh lease), and the
        copies a store had to keep (the mark then stays, so a later pass finishes)."""
        if not decision.was_marked:
            self._mark(decision, now)  # delete_delay=0: marked and deleted at once
        current = datetime.now(timezone.utc)
        leased = [
            expiry
            for store in self.stores  # a reader may be reading any tier's copy
            for expiry in read_leases(store, current, [decision.name]).get(decision.name, [])
            if expiry > current
        ]
        if leased:
            return f"a reader took a lease until {format_timestamp(max(leased))}", []
        tiers = self._tiers(decision)
        retained: list[RetainedCopy] = []
        for index, store in enumerate(self.stores):
            if store not in tiers:
                continue
            if index not in listings:
                listings[index] = {ref.name: ref for ref in store.list_generations()}
            ref = listings[index].get(decision.name)
            if isinstance(store, RetainingStore):
                if ref is not None or not decision.listed:  # also versions an earlier pass left
                    where = f"{store.location}/{decision.name.dirname}"
                    unlisted = GenerationRef(decision.name, where)
                    retained += store.delete_generation_reporting(ref or unlisted)
            elif ref is not None:
                store.delete_generation(ref)
        if not retained:
            remove_mark(tiers, decision.name)
        else:
            logger.warning(
                "generation %s (step %d) is deleted, but %d stored copies of its objects may "
                "not be deleted yet (%s); its deletion mark stays and later passes retry",
                decision.generation_id,
                decision.step,
                len(retained),
                retained[0].reason,
            )
        if decision.listed or not retained:  # its listing went now, or its last copy did
            self._emit_deleted(decision, retained)
        return None, retained

    def _emit_deleted(self, decision: Decision, retained: list[RetainedCopy]) -> None:
        reason = decision.reason
        if retained:
            reason += f"; {len(retained)} stored copies retained ({retained[0].reason})"
        self.emit(
            Deleted(
                self.run_id,
                self._where(decision),
                decision.step,
                decision.generation_id,
                reason,
                format_timestamp(decision.marked_at) if decision.marked_at else None,
            )
        )

    def _drop_expired_leases(self) -> None:
        """Leases of readers that died (they expired) and leases no reader took (too
        long): no planner honours them."""
        now = datetime.now(timezone.utc)
        for store in self.stores:
            try:
                for name in stale_leases(store, now):
                    store.delete_record(LEASE, name)
            except (OSError, CheckpointError) as exc:
                logger.warning("could not remove expired leases in %s: %s", store.location, exc)
