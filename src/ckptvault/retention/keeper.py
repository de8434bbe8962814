"""``RetentionKeeper``: the manager's retention, an event subscriber.

After every ``Published`` event it plans retention and applies it, synchronously,
on the thread that published (the background worker for asynchronous saves), so
``ls`` shows the result once ``close()`` has returned. A replica tier with its own
policy has its own keeper, which runs after each copy into it (see
:mod:`ckptvault.replication.tiers`). The generation just written
is complete (its writer made and checked every byte), so it is the newest verified
generation; one restored is verified too. A failing pass is logged and retried
after the next save: the generation was published either way, and training goes
on. Whatever a pass fails with (a store error, a hostile record, a bug) is logged,
never raised from ``save()``; only a failure to record in the audit log propagates
(it says what happened). Generations are known by name (step and id): an event
makes exactly the generation it names known to verify.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence
from datetime import datetime, timezone

from ckptvault.errors import AuditError, CheckpointError, UsageError
from ckptvault.events import Event, Published, Replicated, Restored
from ckptvault.format.layout import GenerationName
from ckptvault.retention.apply import AppliedPlan
from ckptvault.retention.collector import GarbageCollector
from ckptvault.retention.plan import IN_FLIGHT, KEEP, MARKED, Decision, RetentionPlan
from ckptvault.retention.policy import Retention
from ckptvault.retention.recorded import record_policy
from ckptvault.run_context import RunContext
from ckptvault.storage.base import Store

logger = logging.getLogger("ckptvault")


class RetentionKeeper:
    """Applies ``retention`` to ``stores`` (the first is planned from) after events.

    The local tier's keeper (the default) runs after each ``Published`` event; a
    replica tier's keeper (``after_replication=True``) after each ``Replicated``
    event into its store, on the replicator's thread, once the copy is verified.
    ``unreplicated`` (the replicator's) names generations not yet copied to the
    replica tier: they count as in flight, so the local tier never deletes one
    before its copy exists; when such a copy lands, the local keeper plans again.
    With ``count_only_copied`` (one policy over both tiers) they also do not count
    toward the rules until copied, so the replica keeps what the policy asks of the
    generations it holds (see :mod:`ckptvault.replication.tiers`). Passes never overlap
    (a lock), whichever thread runs them.
    """

    def __init__(
        self,
        run: RunContext,
        retention: Retention,
        stores: Sequence[Store] | None = None,
        *,
        unreplicated: Callable[[], Collection[str]] | None = None,
        after_replication: bool = False,
        count_only_copied: bool = False,
    ) -> None:
        if not isinstance(retention, Retention):
            raise UsageError(f"retention must be a ckptvault.Retention, got {type(retention)!r}")
        self.run = run
        self.retention = retention
        self.collector = GarbageCollector(
            list(stores) if stores else [run.store],
            retention.rules,
            retention.delete_delay,
            policy=run.trust.policy(run.run_id, None),
            run_id=run.run_id,
            emit=run.events.emit,
        )
        # With a ledger, only the marks it recorded count, as in restore.
        self.collector.recorded_marks = lambda: run.trust.recorded_marks(run.run_id)
        self.store = self.collector.store
        self.locations = frozenset(store.location for store in self.collector.applier.stores)
        self.unreplicated = unreplicated
        self.after_replication = after_replication
        self.count_only_copied = count_only_copied
        self.last_plan: RetentionPlan | None = None
        self.last_applied: AppliedPlan | None = None
        self._pass = threading.Lock()
        self._awaiting: frozenset[str] = frozenset()  # dropped, but waiting for a copy
        self._recorded = False  # the policy is recorded in the stores once per keeper

    @classmethod
    def attach(
        cls, run: RunContext, retention: Retention | None, tiers: Sequence[Store] = ()
    ) -> RetentionKeeper | None:
        """Subscribe a keeper to ``run``'s events; None (and nothing) without retention.
        Its marks and deletions reach ``run.store`` and every other tier given."""
        if retention is None:
            return None
        keeper = cls(run, retention, [run.store, *tiers])
        run.events.subscribe(keeper)
        return keeper

    def __call__(self, event: Event) -> None:
        if isinstance(event, Restored):
            if event.store in self.locations:
                self.collector.known[GenerationName(event.step, event.generation_id)] = True
        elif isinstance(event, Published) and not self.after_replication:
            self.collector.known[GenerationName(event.step, event.generation_id)] = True
            self.apply_now(in_flight=(event.generation_id,))
        elif isinstance(event, Replicated):
            if self.after_replication and event.target == self.store.location:
                # Every byte was checked on its way.
                self.collector.known[GenerationName(event.step, event.generation_id)] = True
                self.apply_now()
            elif event.store == self.store.location and self._was_awaiting(event.generation_id):
                self.apply_now()  # its copy exists now: what only waited for it may go

    def _was_awaiting(self, generation_id: str) -> bool:
        # After any pass in progress: it may have seen the copy as still pending.
        with self._pass:
            return generation_id in self._awaiting

    def apply_now(self, in_flight: Sequence[str] = ()) -> AppliedPlan | None:
        with self._pass:
            waiting = frozenset(self.unreplicated()) if self.unreplicated else frozenset()
            try:
                floor = self.run.trust.floor(self.run.run_id)
                plan = self.collector.plan(
                    floor=floor,
                    in_flight={*in_flight, *waiting},
                    uncounted=waiting if self.count_only_copied else (),
                )
                applied = self.collector.apply(plan)
            except AuditError:
                raise
            except Exception as exc:  # a save must not fail for its retention pass
                logger.error(
                    "retention (%s) failed in %s: %s; nothing more was deleted, and the next "
                    "save retries",
                    self.retention.describe(),
                    self.store.location,
                    exc if isinstance(exc, (OSError, CheckpointError)) else repr(exc),
                    exc_info=not isinstance(exc, (OSError, CheckpointError)),
                )
                return None
            self._awaiting = (
                waiting  # each copy that lands changes what the rules count: plan again
                if self.count_only_copied
                else frozenset(
                    d.generation_id
                    for d in plan.decisions
                    if d.generation_id in waiting and _only_in_flight(d)
                )
            )
            self.last_plan, self.last_applied = plan, applied
            self._record_policy()
            return applied

    def _record_policy(self) -> None:
        """Record the policy in the stores it applies to, once per keeper, so that
        ``ckptvault gc`` keeps what it keeps (:mod:`ckptvault.retention.recorded`)."""
        if self._recorded:
            return
        self._recorded = True
        for store in self.collector.applier.stores:
            try:
                record_policy(store, self.run.run_id, self.retention, datetime.now(timezone.utc))
            except (OSError, CheckpointError) as exc:
                logger.warning(
                    "could not record the retention policy in %s: %s (ckptvault gc there "
                    "applies only the rules given to it)",
                    store.location,
                    exc,
                )


def _only_in_flight(decision: Decision) -> bool:
    """Whether only being in flight kept this generation from being marked or deleted
    (kept ones list their keep reasons first; a marked one waits for its delay too)."""
    if decision.action == MARKED:
        return IN_FLIGHT in decision.reasons
    return decision.action == KEEP and decision.reasons[:1] == (IN_FLIGHT,)
