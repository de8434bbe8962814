"""Building the memory tier's parts beside a manager's own (see ``ckptvault.assembly``)."""

from __future__ import annotations

from typing import Any

from ckptvault.errors import UsageError
from ckptvault.events import Deleted, Event, EventBus, Marked, Unmarked
from ckptvault.memory.nodes import NodeMemoryStore
from ckptvault.memory.tier import (
    MemoryTier,
    check_shared_directories,
    node_name,
    tier_directory,
)
from ckptvault.memory.writer import TieredWriter
from ckptvault.retention.keeper import RetentionKeeper
from ckptvault.retention.policy import Retention
from ckptvault.run_context import RunContext
from ckptvault.saving.generation_writer import GenerationWriter
from ckptvault.storage import open_store
from ckptvault.storage.base import Store


def attach_memory_tier(
    run: RunContext, writer: GenerationWriter, tier: MemoryTier
) -> tuple[TieredWriter, Store]:
    """The writer that saves into ``tier`` and every ``durable_every``-th time into
    ``run``'s store through ``writer``, and the tier's store (restore reads it first).
    Every rank calls it; on several nodes each has its own directory
    (:mod:`ckptvault.memory.nodes`)."""
    if not isinstance(tier, MemoryTier):
        raise UsageError(f"memory_tier must be a ckptvault.MemoryTier, got {type(tier)!r}")
    nodes = [str(node) for node in run.coordinator.all_gather(node_name())]
    directory = tier_directory(tier, run.run_id)
    if run.coordinator.world_size > 1:
        check_shared_directories(directory, nodes, run.coordinator)
    store: Store = (
        NodeMemoryStore(directory, nodes, run.coordinator, run.trust.policy(run.run_id, None))
        if len(set(nodes)) > 1
        else open_store(str(directory))
    )
    memory_run = RunContext(store, run.run_id, run.trust, run.coordinator, run.events)
    memory = GenerationWriter(memory_run, writer.contract, writer.settings, writer.collective)
    # The keeper's marks and deletions concern the memory tier alone (see MemoryLedger).
    keeping = EventBus()
    keeper_run = RunContext(store, run.run_id, run.trust, run.coordinator, keeping)
    keeper = RetentionKeeper(keeper_run, Retention(keep_last=tier.keep, delete_delay=0), [store])
    run.events.subscribe(keeper)  # it learns of each publish (and trusts it) there
    tiered = TieredWriter(memory, writer, tier, keeper)
    if run.trust.ledger is not None:
        keeping.subscribe(MemoryLedger(run.trust.ledger, tiered))
    return tiered, store


class MemoryLedger:
    """The ledger's view of the memory tier's own deletions. A generation the keeper
    drops from memory was deleted on purpose: the ledger forgets its publish (restore
    does not count it missing) and its mark, unless the store holds a copy of it
    under the same id, whose publish and marks are the store's to keep."""

    def __init__(self, ledger: Any, writer: TieredWriter) -> None:
        self.ledger, self.writer = ledger, writer

    def __call__(self, event: Event) -> None:
        if event.run_id is None or not isinstance(event, (Marked, Unmarked, Deleted)):
            return
        if self.writer.in_store(event.generation_id):
            return
        if isinstance(event, Marked):
            self.ledger.record_mark(event.run_id, event.step, event.generation_id)
        elif isinstance(event, Unmarked):
            self.ledger.forget_mark(event.run_id, event.generation_id)
        else:
            self.ledger.forget_published(event.run_id, event.generation_id)
            self.ledger.forget_mark(event.run_id, event.generation_id)
