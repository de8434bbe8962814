"""Event subscribers that keep the control plane current: the rollback ledger's
floor and the audit log. They only record what the manager's parts already did."""

from __future__ import annotations

from typing import Any, Protocol

from ckptvault.events import (
    Deleted,
    Event,
    Marked,
    Published,
    Refused,
    ReplicasDisagree,
    Restored,
    Unmarked,
)
from ckptvault.trust.ledger import Ledger


class Recording(Protocol):
    """Where the audit recorder writes: :class:`~ckptvault.trust.context.TrustContext`
    (which builds the recorders; this module never imports it)."""

    def record(self, done: str, event: str, **fields: Any) -> None: ...


class FloorKeeper:
    """Raises the run's restore floor on every restore; an allowed rollback lowers it
    and records the rule that abandons every newer generation made before it. It also
    remembers the newest publishes, so that restore notices when one has vanished."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def __call__(self, event: Event) -> None:
        if isinstance(event, Published):
            self.ledger.record_published(event.run_id, event.step, event.generation_id)
            return
        if isinstance(event, Marked) and event.run_id is not None:
            self.ledger.record_mark(event.run_id, event.step, event.generation_id)
            return
        if isinstance(event, Unmarked) and event.run_id is not None:
            self.ledger.forget_mark(event.run_id, event.generation_id)
            return
        if isinstance(event, Deleted) and event.run_id is not None:
            self.ledger.forget_published(event.run_id, event.generation_id)
            self.ledger.forget_mark(event.run_id, event.generation_id)
            return
        if not isinstance(event, Restored):
            return
        if event.rollback is not None:
            self.ledger.lower_floor(
                event.run_id,
                event.step,
                event.generation_id,
                event.rollback.abandoned,
                event.rollback.cutoff_generation_id,
            )
        else:
            self.ledger.record_restore(event.run_id, event.step, event.generation_id)


class AuditRecorder:
    """Appends one audit entry per event (two for an allowed rollback)."""

    def __init__(self, trust: Recording) -> None:
        self.trust = trust

    def __call__(self, event: Event) -> None:
        if isinstance(event, Published):
            self._published(event)
        elif isinstance(event, Restored):
            self._restored(event)
        elif isinstance(event, Refused):
            self._refused(event)
        elif isinstance(event, ReplicasDisagree):
            self._replicas(event)
        elif isinstance(event, (Marked, Unmarked, Deleted)):
            self._lifecycle(event)

    def _published(self, event: Published) -> None:
        self.trust.record(
            event.summary,
            "save",
            run_id=event.run_id,
            step=event.step,
            generation_id=event.generation_id,
            store=event.store,
            bytes=event.bytes,
            signer=event.signer,
            kek_id=event.kek_id,
        )

    def _restored(self, event: Restored) -> None:
        if event.rollback is not None:
            self.trust.record(
                f"the rollback to step {event.step} was applied",
                "rollback_allowed",
                run_id=event.run_id,
                store=event.store,
                previous_floor=event.rollback.previous_floor,
                from_step=event.rollback.from_step,
                step=event.step,
                generation_id=event.generation_id,
                abandoned=[list(a) for a in event.rollback.abandoned],
                cutoff_generation_id=event.rollback.cutoff_generation_id,
            )
        self.trust.record(
            event.summary,
            "restore",
            run_id=event.run_id,
            store=event.store,
            step=event.step,
            generation_id=event.generation_id,
            skipped=[list(s) for s in event.skipped],
        )

    def _refused(self, event: Refused) -> None:
        self.trust.record(
            event.summary,
            "refusal",
            run_id=event.run_id,
            store=event.store,
            error=event.error,
            reason=event.reason,
            rejected=[list(r) for r in event.rejected],
        )

    def _replicas(self, event: ReplicasDisagree) -> None:
        self.trust.record(
            event.summary,
            "replica_mismatch",
            run_id=event.run_id,
            store=event.store,
            step=event.step,
            generation_id=event.generation_id,
            slots=list(event.slots),
        )

    def _lifecycle(self, event: Marked | Unmarked | Deleted) -> None:
        kind = {Marked: "mark", Unmarked: "unmark", Deleted: "delete"}[type(event)]
        fields = {"marked_at": event.marked_at} if not isinstance(event, Unmarked) else {}
        self.trust.record(
            event.summary,
            kind,
            run_id=event.run_id,
            store=event.store,
            step=event.step,
            generation_id=event.generation_id,
            reason=event.reason,
            **fields,
        )
