"""Drills of the trust rules that decide *whether* a run may resume, and from where.

- rollback offered (``RollbackError``): the run restores its newest generation
  (the ledger's floor rises to it); then the newest is removed, so that an older
  generation is presented as the newest. Restore refuses to go below the floor
  silently and raises ``RollbackError``.
- key destroyed (``KeyDestroyedError``): an encrypted run's key is crypto-erased
  (in a copy of the key store); restore raises ``KeyDestroyedError`` and applies
  nothing. Skipped for a run that is not encrypted.
- remote tier only: the local tier is empty (the node was replaced), the generations
  are in the replica (``replicate_to``); restore takes the newest from there.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ckptvault.errors import KeyDestroyedError, RollbackError
from ckptvault.ops.drills.base import Drill, DrillSkipped, timed_restore
from ckptvault.ops.drills.context import DrillContext

Outcome = tuple[bool, str, dict[str, float]]


def remove_generation(location: str) -> None:
    """Delete a generation directory of a drill's copy (read-only files included)."""
    for root, dirs, _files in os.walk(location):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o755)
    os.chmod(location, 0o755)
    shutil.rmtree(location)


def _rollback_drill(context: DrillContext) -> Outcome:
    label = "rollback"
    store = context.fresh_copy(label)
    refs = context.generations(store)
    if len(refs) < 2:
        raise DrillSkipped("the store holds one generation: there is nothing older to offer")
    state, strict = context.new_state()
    with context.manager(store, label) as manager:
        first = timed_restore(manager, state, strict)
    remove_generation(refs[0].location)
    state, strict = context.new_state()
    with context.manager(store, label) as manager:
        offered = timed_restore(manager, state, strict)
    passed = (
        first.info is not None
        and first.info.generation_id == refs[0].generation_id
        and isinstance(offered.error, RollbackError)
        and offered.info is None
    )
    observed = (
        f"first restore: {first.describe()}; newest (step {refs[0].step}) removed, step "
        f"{refs[1].step} offered as newest; second restore: {offered.describe()}"
    )
    return passed, observed, offered.timings


def _key_destroyed_drill(context: DrillContext) -> Outcome:
    if context.keystore is None:
        raise DrillSkipped("the run is not encrypted: there is no key to destroy")
    from ckptvault.trust.keystores import open_keystore

    label = "key-destroyed"
    store = context.fresh_copy(label)
    keys = context.workdir(label) / "keys"
    shutil.copytree(context.keystore, keys)  # erase a copy, never the run's key store
    open_keystore(keys).destroy(context.run_id)
    state, strict = context.new_state()
    with context.manager(store, label, keystore=keys) as manager:
        outcome = timed_restore(manager, state, strict)
    passed = isinstance(outcome.error, KeyDestroyedError) and outcome.info is None
    return passed, f"key of run {context.run_id!r} destroyed; {outcome.describe()}", outcome.timings


def _remote_only_drill(context: DrillContext) -> Outcome:
    label = "remote-tier-only"
    remote = context.fresh_copy(label)
    newest = context.generations(remote)[0]
    local = context.workdir(label) / "local"  # the replaced node's empty disk
    state, strict = context.new_state()
    with context.manager(local, label, replicate_to=remote) as manager:
        outcome = timed_restore(manager, state, strict)
    came_back = any(True for _ in context.generations(local)) if local.exists() else False
    info = outcome.info
    passed = (
        info is not None
        and info.generation_id == newest.generation_id
        and Path(info.path).parent == remote
    )
    where = f" from {info.path}" if info is not None else ""
    observed = (
        f"local tier empty, replica holds step {newest.step}; {outcome.describe()}{where}; "
        f"copied back to the local tier: {'yes' if came_back else 'no'}"
    )
    return passed, observed, outcome.timings


TRUST_DRILLS = [
    Drill(
        "rollback",
        "an older generation offered as newest below the floor: RollbackError, nothing applied",
        _rollback_drill,
    ),
    Drill(
        "key-destroyed",
        "after crypto-erase restore raises KeyDestroyedError, nothing applied",
        _key_destroyed_drill,
    ),
    Drill(
        "remote-tier-only",
        "local tier lost: the newest generation restored from the replica tier",
        _remote_only_drill,
    ),
]
