"""Deleting what Lightning removed, through ckptvault's own retention machinery.

When ``ModelCheckpoint`` drops a checkpoint (``save_top_k``) or overwrites
``last.ckpt``, the generation that pointer named is no longer wanted. It is not
unlinked by hand: a :class:`~ckptvault.lifecycle.collector.GarbageCollector` pass
with one rule, "keep everything but what Lightning removed and no pointer still
names", decides and applies, so every protection of retention holds. The newest
verified generation and one verified fallback are kept, as are pins, the restore
floor's generation and generations a reader holds a lease on. ``delete_delay`` gives
the two-phase deletion (mark now, delete later; ``ckptvault gc --undelete`` in
between). A generation kept for one of those reasons goes on a later pass, once
nothing protects it any more.

Only generations of this run that a pointer named are ever candidates, and only
their decisions are applied: generations the plugin never pointed at (another run's,
or saved with ``CheckpointManager`` directly) and marks others made (``ckptvault
gc``, the manager's own ``retention=``) are never touched.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from ckptvault.errors import AuditError, CheckpointError
from ckptvault.events import Event, Published, Restored
from ckptvault.format.layout import GenerationName
from ckptvault.integrations.lightning_pointers import (
    Pointer,
    pointers_in,
    read_released,
    write_released,
)
from ckptvault.lifecycle.apply import AppliedPlan
from ckptvault.lifecycle.collector import GarbageCollector
from ckptvault.lifecycle.retention import RuleInput

if TYPE_CHECKING:
    from ckptvault.manager import CheckpointManager

logger = logging.getLogger("ckptvault")

REMOVED_REASON = "kept: Lightning still uses it"


class KeepUnlessRemoved:
    """A retention rule: keeps every generation except those in ``removed``."""

    def __init__(self) -> None:
        self.removed: frozenset[GenerationName] = frozenset()

    def keeps(self, generations: Sequence[RuleInput], now: datetime) -> dict[GenerationName, str]:
        return {g.name: REMOVED_REASON for g in generations if g.name not in self.removed}


class LightningPruner:
    """Tracks the generations Lightning let go of and prunes them from the store.

    Each checkpoint directory keeps a journal of what was released in it
    (:func:`~ckptvault.integrations.lightning_pointers.read_released`), so that a
    generation retention had to keep (the verified fallback, say) is still pruned by
    the next process once nothing protects it."""

    def __init__(self, manager: CheckpointManager, delete_delay: float) -> None:
        self.manager = manager
        self.rule = KeepUnlessRemoved()
        self.collector = GarbageCollector(
            [manager.store],
            [self.rule],
            delete_delay,
            policy=manager.trust.policy(manager.run_id, None),
            run_id=manager.run_id,
            emit=manager.events.emit,
        )
        # Per checkpoint directory: the generations released there and not yet gone.
        self.released: dict[Path, set[GenerationName]] = {}
        manager.events.subscribe(self._heard)

    def _heard(self, event: Event) -> None:
        # What this manager published or restored is known to verify: no re-hashing.
        if isinstance(event, (Published, Restored)) and event.store == self.manager.store.location:
            self.collector.known[GenerationName(event.step, event.generation_id)] = True

    def watch(self, directory: Path) -> None:
        """Count ``directory``'s pointers and journal from now on; what an earlier
        process released there is pruned now, if nothing keeps it any more."""
        if directory not in self.released:
            self.released[directory] = read_released(directory)
            if self.released[directory]:
                self.prune()

    def release(self, pointer: Pointer, directory: Path) -> AppliedPlan | None:
        """Lightning no longer uses ``pointer`` (removed or overwritten in
        ``directory``): prune its generation unless another pointer still names it."""
        self.watch(directory)
        if pointer.run_id != self.manager.run_id:
            logger.warning(
                "not deleting generation %s (step %d): its pointer names run %r, this plugin "
                "writes run %r",
                pointer.generation_id,
                pointer.step,
                pointer.run_id,
                self.manager.run_id,
            )
            return None
        self.released[directory].add(pointer.name)
        write_released(directory, self.released[directory])
        return self.prune()

    def prune(self) -> AppliedPlan | None:
        """One retention pass over the store; None when nothing is to go (or it failed:
        logged, and the next removal retries, as retention after a save does)."""
        named = {p.name for d in self.released for p in pointers_in(d).values()}
        doomed = frozenset(set().union(*self.released.values()) - named)
        if not doomed:
            return None
        self.rule.removed = doomed
        try:
            floor = self.manager.trust.floor(self.manager.run_id)
            plan = self.collector.plan(floor=floor)
            # Only Lightning's removals: a mark made by ``ckptvault gc`` or the manager's
            # own retention (which the rule above would lift) is left to its maker.
            mine = [d for d in plan.decisions if d.name in doomed and d.listed]
            applied = self.collector.apply(replace(plan, decisions=mine))
            listed = {ref.name for ref in self.manager.store.list_generations()}
        except AuditError:
            raise
        except (OSError, CheckpointError) as exc:
            logger.error(
                "could not delete the checkpoints Lightning removed from %s: %s; the next "
                "removal retries",
                self.manager.store.location,
                exc,
            )
            return None
        for directory, names in self.released.items():
            if names - listed:
                names &= listed
                write_released(directory, names)
        return applied
