"""The node-loss drill: a run with a memory tier loses its node's memory.

On a copy of the store, a manager with a memory tier (in the drill's scratch space)
saves three steps past the newest: memory only, memory and the store
(``durable_every=2``), memory only. A restore must come from memory and give the
newest; then the memory tier is emptied, as a lost node or a wiped ``/dev/shm``
leaves it, and a restore in a fresh manager must come from the store and give the
durable one. Both recoveries are timed.
"""

from __future__ import annotations

import shutil

from ckptvault.memory.tier import MemoryTier
from ckptvault.ops.drills.base import Drill, timed_restore
from ckptvault.ops.drills.context import DrillContext

Outcome = tuple[bool, str, dict[str, float]]


def _node_loss_drill(context: DrillContext) -> Outcome:
    label = "node-loss"
    store = context.fresh_copy(label)
    memory = context.workdir(label) / "memory"
    tier = MemoryTier(path=memory, keep=1, durable_every=2)
    newest = context.generations(store)[0].step
    steps = (newest + 1, newest + 2, newest + 3)
    with context.manager(store, label, memory_tier=tier) as manager:
        for step in steps:
            manager.save(step, context.state_to_save(), blocking=True)
    # The two recoveries are two alternative futures of the same run: each starts from
    # the ledger and audit log the saves left (a restore from memory raises the floor).
    lost = context.workdir(f"{label}-lost")
    for name in ("ledger.sqlite3", "audit.log"):
        shutil.copyfile(context.workdir(label) / name, lost / name)
    state, strict = context.new_state()
    with context.manager(store, label, memory_tier=tier) as manager:
        from_memory = timed_restore(manager, state, strict)
    shutil.rmtree(memory)  # the node's memory is gone
    state, strict = context.new_state()
    with context.manager(store, f"{label}-lost", memory_tier=tier) as manager:
        from_store = timed_restore(manager, state, strict)
    first, second = from_memory.info, from_store.info
    passed = (
        first is not None
        and (first.step, first.source) == (steps[2], "memory")
        and second is not None
        and (second.step, second.source) == (steps[1], "store")
    )
    observed = (
        f"with memory: {from_memory.describe()} from {first.source if first else '-'}; "
        f"memory lost: {from_store.describe()} from {second.source if second else '-'}"
    )
    timings = {
        "memory_recovery": from_memory.timings.get("recovery", 0.0),
        "store_recovery": from_store.timings.get("recovery", 0.0),
    }
    return passed, observed, timings


MEMORY_DRILLS = [
    Drill(
        "node-loss",
        "with a memory tier, a restore takes the newest save from memory; with the "
        "node's memory lost, the newest durable one from the store",
        _node_loss_drill,
    ),
]
