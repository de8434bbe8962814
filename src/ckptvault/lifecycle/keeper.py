"""``RetentionKeeper``: the manager's retention, an event subscriber.

After every ``Published`` event it plans retention and applies it, synchronously,
on the thread that published (the background worker for asynchronous saves), so
``ls`` shows the result once ``close()`` has returned. The generation just written
is complete (its writer made and checked every byte), so it is the newest verified
generation; one restored is verified too. A failing pass is logged and retried
after the next save: the generation was published either way, and training goes
on. Only a failure to record in the audit log propagates (it says what happened).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ckptvault.errors import AuditError, CheckpointError, UsageError
from ckptvault.events import Event, Published, Restored
from ckptvault.lifecycle.apply import AppliedPlan
from ckptvault.lifecycle.collector import GarbageCollector
from ckptvault.lifecycle.plan import RetentionPlan
from ckptvault.lifecycle.retention import Retention
from ckptvault.run_context import RunContext
from ckptvault.storage.base import Store

logger = logging.getLogger("ckptvault")


class RetentionKeeper:
    def __init__(
        self, run: RunContext, retention: Retention, stores: Sequence[Store] | None = None
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
        self.last_plan: RetentionPlan | None = None
        self.last_applied: AppliedPlan | None = None

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
            self.collector.known[event.generation_id] = True
        elif isinstance(event, Published):
            self.collector.known[event.generation_id] = True
            self.apply_now(in_flight=(event.generation_id,))

    def apply_now(self, in_flight: Sequence[str] = ()) -> AppliedPlan | None:
        try:
            floor = self.run.trust.floor(self.run.run_id)
            plan = self.collector.plan(floor=floor, in_flight=in_flight)
            applied = self.collector.apply(plan)
        except AuditError:
            raise
        except (OSError, CheckpointError) as exc:
            logger.error(
                "retention (%s) failed in %s: %s; nothing more was deleted, and the next save "
                "retries",
                self.retention.describe(),
                self.run.store.location,
                exc,
            )
            return None
        self.last_plan, self.last_applied = plan, applied
        return applied
