"""Deleting what Lightning removed, through ckptvault's own retention machinery.

When ``ModelCheckpoint`` drops a checkpoint (``save_top_k``) or overwrites
``last.ckpt``, the generation that pointer named is no longer wanted. It is not
unlinked by hand: a :class:`~ckptvault.retention.collector.GarbageCollector` pass
with one rule, "keep everything but what Lightning removed and no pointer still
names", decides and applies, so every protection of retention holds. The newest
verified generation and one verified fallback are kept, as are pins, the restore
floor's generation and generations a reader holds a lease on. ``delete_delay`` gives
the two-phase deletion (mark now, delete later; ``ckptvault gc --undelete`` in
between). A generation kept for one of those reasons goes on a later pass, once
nothing protects it any more.

Only generations the plugin itself put at a path Lightning then removed or
overwrote are ever candidates (its records in the store say which:
:mod:`~ckptvault.integrations.lightning_records`; the pointer files in the checkpoint
directory decide nothing), and only their decisions are applied: generations the
plugin never pointed at (another run's, or saved with ``CheckpointManager``
directly) and marks others made (``ckptvault gc``, the manager's own ``retention=``)
are never touched.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from ckptvault.errors import AuditError, CheckpointError
from ckptvault.events import Event, Published, Restored
from ckptvault.format.layout import GenerationName
from ckptvault.integrations.lightning_records import PointerBook
from ckptvault.retention.apply import AppliedPlan
from ckptvault.retention.collector import GarbageCollector
from ckptvault.retention.policy import RuleInput

if TYPE_CHECKING:
    from ckptvault.manager import CheckpointManager

logger = logging.getLogger("ckptvault")

REMOVED_REASON = "kept: Lightning still uses it"
T = TypeVar("T")


class KeepUnlessRemoved:
    """A retention rule: keeps every generation except those in ``removed``."""

    def __init__(self) -> None:
        self.removed: frozenset[GenerationName] = frozenset()

    def keeps(self, generations: Sequence[RuleInput], now: datetime) -> dict[GenerationName, str]:
        return {g.name: REMOVED_REASON for g in generations if g.name not in self.removed}


class LightningPruner:
    """Releases the generations Lightning let go of and prunes them from the store.

    What the plugin put at each path and what was released are records in the store
    (:class:`~ckptvault.integrations.lightning_records.PointerBook`), never read from
    the checkpoint directory: whoever can write that directory cannot make the plugin
    delete anything. A released generation retention had to keep (the verified
    fallback, say) is pruned by a later pass, or by the next process."""

    def __init__(self, manager: CheckpointManager, delete_delay: float) -> None:
        self.manager = manager
        self.book = PointerBook(manager.store)
        self.rule = KeepUnlessRemoved()
        self.collector = GarbageCollector(
            [manager.store],
            [self.rule],
            delete_delay,
            policy=manager.trust.policy(manager.run_id, None),
            run_id=manager.run_id,
            emit=manager.events.emit,
        )
        self._started = False
        manager.events.subscribe(self._heard)

    def _heard(self, event: Event) -> None:
        # What this manager published or restored is known to verify: no re-hashing.
        if isinstance(event, (Published, Restored)) and event.store == self.manager.store.location:
            self.collector.known[GenerationName(event.step, event.generation_id)] = True

    def start(self) -> None:
        """Once per process: prune what an earlier process released, if nothing keeps
        it any more."""
        if not self._started:
            self._started = True
            if self._released():
                self.prune()

    def pointed(self, path: Path, name: GenerationName) -> None:
        """The plugin put a pointer to ``name`` at ``path``: record it (after the
        pointer file is durable), and release what the plugin had put there before."""
        self.start()
        previous = self._book(lambda: self.book.at(path))
        self._book(lambda: self.book.put(path, name))
        if previous is not None and previous != name:
            self.release(previous)  # an overwritten last.ckpt

    def removed(self, path: Path) -> None:
        """Lightning removed the pointer at ``path``: release what the plugin put there
        (whatever the file said: it was only a hint)."""
        self.start()
        name = self._book(lambda: self.book.at(path))
        if name is None:
            return
        self._book(lambda: self.book.drop(path))
        self.release(name)

    def release(self, name: GenerationName) -> AppliedPlan | None:
        """Lightning no longer uses ``name``: prune it unless a pointer record still
        names it."""
        try:
            self.book.release(name)
        except (OSError, CheckpointError) as exc:
            self._failed("record a release in", exc)  # not recorded: it stays
            return None
        return self.prune()

    def prune(self) -> AppliedPlan | None:
        """One retention pass over the store; None when nothing is to go (or it failed:
        logged, and the next removal retries, as retention after a save does)."""
        released = self._released()
        named = self._book(self.book.named)
        if not released or named is None:
            return None
        doomed = frozenset(released - named)
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
            self._failed("delete the checkpoints Lightning removed from", exc)
            return None
        self._book(lambda: self.book.forget(released - listed))
        return applied

    def _released(self) -> set[GenerationName]:
        return self._book(self.book.released) or set()

    def _book(self, call: Callable[[], T]) -> T | None:
        """``call()`` on the store's records; None (logged) when the store fails: the
        generations stay, and the next save or removal tries again."""
        try:
            return call()
        except (OSError, CheckpointError) as exc:
            self._failed("keep the plugin's records in", exc)
            return None

    def _failed(self, what: str, exc: BaseException) -> None:
        logger.error(
            "could not %s %s: %s; nothing more was deleted, the next removal retries",
            what,
            self.manager.store.location,
            exc,
        )
