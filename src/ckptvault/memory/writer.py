"""Saving with a memory tier: every save into memory, every ``durable_every``-th
also into the store.

The memory copy is written as any generation is (collectively on several ranks),
then, on a durable save, copied into the store under the same name by the
coordinator, every byte checked against the memory manifest's digests on its way
(:func:`~ckptvault.replication.replicator.copy_generation`): the store's copy is
never better than verified, and restore sees one generation in two tiers (the memory
one first). Every rank learns the copy's outcome, so a failed durable copy fails
the save on every rank alike.

A memory save that does not fit (the tier's free space is checked before writing) is
skipped with a warning and a ``MemorySkipped`` event; a durable save then goes to
the store directly. Training never fails for want of memory. After each memory
publish only the newest ``keep`` generations stay in memory (a retention keeper of
the memory tier, told of each publish: the same trust rule as every other deletion).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckptvault.errors import CheckpointError, SaveFailedError, StorageFullError
from ckptvault.events import MemorySkipped
from ckptvault.format.layout import GenerationName
from ckptvault.memory.nodes import NodeMemoryStore, complete_locally, copy_to_peers
from ckptvault.replication.replicator import copy_generation, find_generation
from ckptvault.saving.save_watch import SaveWatcher, progress_of, watched
from ckptvault.storage.listing import GenerationInfo
from ckptvault.trust.checks import TrustPolicy

if TYPE_CHECKING:
    from ckptvault.memory.tier import MemoryTier
    from ckptvault.retention.keeper import RetentionKeeper
    from ckptvault.saving.generation_writer import GenerationWriter, WrittenGeneration
    from ckptvault.state.capture import CapturedState

logger = logging.getLogger("ckptvault")


class TieredWriter:
    """The manager's writer with a memory tier (see the module docstring).
    ``memory`` and ``durable`` write the same run into the memory tier's store and
    into the store; ``keeper`` keeps the memory tier to ``tier.keep``."""

    def __init__(
        self,
        memory: GenerationWriter,
        durable: GenerationWriter,
        tier: MemoryTier,
        keeper: RetentionKeeper,
    ) -> None:
        self.memory, self.durable, self.tier, self.keeper = memory, durable, tier, keeper
        self.coordinator = durable.coordinator
        self.saves = 0  # saves written by this manager: which ones are durable
        self._locked = False
        # Per generation id written to memory: the store's copy, once made.
        self._copies: dict[str, GenerationInfo] = {}
        self._direct: set[str] = set()  # generation ids written to the store directly
        self.durable_ids: set[str] = set()  # generation ids copied into the store
        self._forced: set[int] = set()  # steps whose save must reach the store
        self._next_durable = False  # the next save reaches the store (after a restore)
        self.watcher: SaveWatcher | None = None

    def watch(self, watcher: SaveWatcher | None) -> None:
        """Tell ``watcher`` what each save writes, the durable copy included
        (:mod:`ckptvault.saving.save_watch`)."""
        self.watcher = watcher
        self.memory.watch(watcher)
        self.durable.watch(watcher)

    # The generation last saved or restored, and the contract: both writers' own.
    @property
    def parent(self) -> str | None:
        return self.durable.parent

    @parent.setter
    def parent(self, value: str | None) -> None:
        self.memory.parent = self.durable.parent = value

    @property
    def contract(self) -> dict[str, Any]:
        return self.durable.contract

    def write(
        self, step: int, captured: CapturedState, metrics: dict[str, int | float] | None
    ) -> WrittenGeneration | None:
        """One save: into memory (unless it does not fit), and on every
        ``durable_every``-th into the store. None when nothing was written."""
        with watched(self.watcher):  # one save, from the memory write to the copy
            return self._write(step, captured, metrics)

    def _write(
        self, step: int, captured: CapturedState, metrics: dict[str, int | float] | None
    ) -> WrittenGeneration | None:
        self.saves += 1
        durable = (
            self.saves % self.tier.durable_every == 0 or step in self._forced or self._next_durable
        )
        self._forced.discard(step)
        self._next_durable = False
        written = self._write_memory(step, captured, metrics)
        if written is None:
            if not durable:
                return None
            direct = self.durable.write(step, captured, metrics)
            self._direct.add(direct.info.generation_id)
            return direct
        self.durable.parent = self.memory.parent
        if isinstance(self.memory.store, NodeMemoryStore):
            self._to_peers(self.memory.store, written)
        if durable:
            self._copy(written)
        return written

    def _to_peers(self, store: NodeMemoryStore, written: WrittenGeneration) -> None:
        """Several nodes: copies on ``peers`` other nodes, and each node's memory kept
        to ``keep`` (a failed copy is a warning: fewer copies, the save stands)."""
        info = written.info
        dirname = Path(info.path).name if self.coordinator.is_coordinator else None
        errors, name = copy_to_peers(store, dirname, self.tier.peers)
        if errors and self.coordinator.is_coordinator:
            logger.warning(
                "step %d is in memory on fewer nodes than peers=%d asks: %s",
                info.step,
                self.tier.peers,
                "; ".join(errors)[:2000],
            )
        leading = store.leaders()[store.node] == store.coordinator.rank
        if leading and not self.coordinator.is_coordinator:  # rank 0's: by announce()
            if name is not None and not errors:
                # A copy of what rank 0 just published: it counts as this keeper's own.
                self.keeper.collector.known[name] = True
            self.keeper.apply_now()

    def before_restore(self) -> set[str]:
        """Collective, before a restore: on several nodes, each fetches from its peers
        the generations it lacks (:func:`complete_locally`); the ids it fetched."""
        if isinstance(self.memory.store, NodeMemoryStore):
            return complete_locally(self.memory.store)
        return set()

    def announce(self, written: WrittenGeneration) -> None:
        """Publish events for the memory generation and its store copy, then keep the
        memory tier to ``keep`` generations."""
        copy = self._copies.pop(written.info.generation_id, None)
        if written.info.generation_id in self._direct:  # written to the store directly
            self._direct.discard(written.info.generation_id)
            self.durable.announce(written)
            return
        self.memory.announce(written)  # the keeper, subscribed, marks what `keep` drops
        if self.coordinator.is_coordinator:
            self.keeper.apply_now()  # and deletes it now (delete_delay=0): memory is scarce
        if copy is not None:
            self.durable.announce(replace(written, info=copy))

    def make_durable(self, step: int) -> None:
        """The save of ``step`` (about to be submitted) goes to the store too."""
        self._forced.add(step)

    def make_next_durable(self) -> None:
        """The next save goes to the store too: after a restore from memory, whose
        progress the store lacks (every rank restored the same way, so every rank
        decides alike). Counting saves restarts with each manager: without this, a
        job restarted more often than every ``durable_every`` saves would never
        reach the store."""
        self._next_durable = True

    def in_store(self, generation_id: str) -> bool:
        """Whether the store holds a copy of this memory generation (this manager's
        copies, or one listed there: a copy made before a restart)."""
        if generation_id in self.durable_ids:
            return True
        return any(
            ref.generation_id == generation_id for ref in self.durable.store.list_generations()
        )

    def announce_failure(
        self, step: int, error: BaseException, stall_seconds: float, total_seconds: float
    ) -> None:
        self.durable.announce_failure(step, error, stall_seconds, total_seconds)

    def close(self) -> None:
        self.memory.close()
        self.durable.close()
        if self._locked:
            self.memory.store.release_writer()
            self._locked = False

    # -- parts ---------------------------------------------------------------------------

    def _write_memory(
        self, step: int, captured: CapturedState, metrics: dict[str, int | float] | None
    ) -> WrittenGeneration | None:
        if not self._locked and self._keeps_node():
            self.memory.store.acquire_writer()
            self._locked = True
            if not self.coordinator.is_coordinator:  # rank 0's save sweeps its own node
                self._sweep()
        try:
            return self.memory.write(step, captured, metrics)
        except (StorageFullError, SaveFailedError) as exc:
            if isinstance(exc, SaveFailedError) and "StorageFullError" not in str(exc):
                raise
            warnings.warn(
                f"ckptvault: the memory tier has no room for step {step} "
                f"({self.memory.store.location}); the save goes on without it: {exc}",
                RuntimeWarning,
                stacklevel=2,
            )
            if self.coordinator.is_coordinator:
                self.memory.events.emit(
                    MemorySkipped(
                        run_id=self.memory.run_id,
                        store=self.memory.store.location,
                        step=step,
                        reason=str(exc).splitlines()[0][:2000],
                    )
                )
            return None

    def _keeps_node(self) -> bool:
        """Whether this rank keeps its node's directory: rank 0, and on several nodes
        the first rank of every other node (it holds that directory's writer lock)."""
        store = self.memory.store
        if self.coordinator.is_coordinator:
            return True
        return isinstance(store, NodeMemoryStore) and store.leaders()[store.node] == (
            self.coordinator.rank
        )

    def _sweep(self) -> None:
        """Remove what a crash left in this node's staging (a partial copy from a peer,
        files shipped only halfway): memory is scarce."""
        try:
            removed = self.memory.store.remove_stale_staging()
        except (OSError, CheckpointError) as exc:
            logger.warning("could not clear %s's staging: %s", self.memory.store.location, exc)
            return
        if removed:
            logger.info(
                "removed %d staging leftover(s) from %s", len(removed), self.memory.store.location
            )

    def _copy(self, written: WrittenGeneration) -> None:
        """The memory generation into the store, verified, by the coordinator; every
        rank raises the same error when it fails."""
        info = written.info
        outcome: dict[str, Any] = {}
        if self.coordinator.is_coordinator:
            try:
                name = GenerationName(info.step, info.generation_id)
                ref = find_generation(self.memory.store, name)
                if ref is None:
                    raise SaveFailedError(f"{info.path} vanished before its durable copy")
                trust = self.memory.trust
                policy = TrustPolicy(run_id=self.memory.run_id, trusted_keys=trust.trusted)
                copied = copy_generation(
                    self.memory.store,
                    ref,
                    self.durable.store,
                    policy,
                    trust.keystore,
                    progress_of(self.watcher),
                )
                outcome = {"location": copied.location}
            except Exception as exc:  # every rank raises it below
                outcome = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
        if self.coordinator.world_size > 1:
            outcome = self.coordinator.broadcast(outcome)
        if "error" in outcome:
            raise SaveFailedError(
                f"step {info.step} was saved to the memory tier ({info.path}) but its "
                f"durable copy into {self.durable.store.location} failed: {outcome['error']}"
            )
        self._copies[info.generation_id] = replace(info, path=str(outcome["location"]))
        self.durable_ids.add(info.generation_id)
