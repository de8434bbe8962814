"""What a DCP plugin save or load tells the run's control plane (with ``ledger=``).

The plugin emits the manager's own events to the manager's own subscribers
(:meth:`~ckptvault.trust.context.TrustContext.subscribers`): ``Published`` after a
save (the ledger's published table remembers it, so that its later disappearance
is a loud, counted fallback; the audit log writes a ``save`` entry), ``Restored``
once a load has read and verified the coordinator's share (the floor rises to it,
or an allowed rollback lowers it and abandons every newer generation made before
it; ``restore``/``rollback_allowed`` entries) and ``Refused`` when choosing fails.
Without a ledger there are no subscribers and every call here does nothing. Only
the coordinator records, once for the job.
"""

from __future__ import annotations

import logging

from ckptvault.errors import CheckpointError
from ckptvault.events import EventBus, Published, Refused, Restored, RollbackApplied
from ckptvault.restoring.rollback import warn_rollback
from ckptvault.restoring.selector import SkippedGeneration
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.storage.listing import GenerationInfo
from ckptvault.trust.context import TrustContext

logger = logging.getLogger("ckptvault")


class PluginRecords:
    """The events of one plugin object (a writer's saves, or a reader's one load)."""

    def __init__(self, trust: TrustContext, store: Store, run_id: str) -> None:
        self.trust = trust
        self.store = store
        self.run_id = run_id
        self.events = EventBus(trust.subscribers())

    def newest_cutoff(self) -> str | None:
        """New generation ids must sort after the run's latest rollback cutoff (else
        the new generation would count as abandoned by it); None without a ledger."""
        floor = self.trust.floor(self.run_id)
        return floor.newest_cutoff if floor is not None else None

    def published(self, info: GenerationInfo, seconds: float, kek_id: str | None) -> None:
        """A save of the plugin became visible (the coordinator, after publish)."""
        self.events.emit(
            Published(
                run_id=self.run_id,
                store=self.store.location,
                step=info.step,
                generation_id=info.generation_id,
                location=info.path,
                bytes=info.bytes,
                seconds=seconds,
                signer=self.trust.signer_id,
                kek_id=kek_id,
            )
        )

    def restored(
        self,
        ref: GenerationRef,
        skipped: list[SkippedGeneration],
        rollback: RollbackApplied | None,
    ) -> None:
        """A load read and verified the chosen generation (the coordinator's share)."""
        if rollback is not None:
            warn_rollback(rollback, ref, self.run_id)
        self.events.emit(
            Restored(
                run_id=self.run_id,
                store=self.store.location,
                step=ref.step,
                generation_id=ref.generation_id,
                skipped=list(skipped),
                rollback=rollback,
            )
        )

    def refused(self, exc: CheckpointError) -> None:
        """Choosing a generation failed: nothing will be loaded. A failure to record
        it is logged, never raised over the refusal itself."""
        reason = str(exc).splitlines()[0][:2000] if str(exc) else type(exc).__name__
        event = Refused(
            run_id=self.run_id,
            store=self.store.location,
            error=type(exc).__name__,
            reason=reason,
            rejected=list(getattr(exc, "rejected", [])),
        )
        try:
            self.events.emit(event)
        except Exception as failure:
            logger.error("could not record a refusal: %s", failure)
