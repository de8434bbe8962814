"""One save of a multi-rank job: every rank writes, one manifest, one publish.

Every rank runs the same phases in the same order; each phase ends with a collective
that tells every rank whether all of them succeeded, so that no rank waits in a
collective the others will never reach:

1. the coordinator removes stale attempts, checks capacity, draws the generation id
   and begins the staging area; the id (or its error) is broadcast;
2. every other rank joins the staging area; the outcomes are gathered;
3. every rank writes its tensors through DCP's planner, driven over ckptvault's own
   JSON collectives (:mod:`ckptvault.distributed.dcp_save`; ``dcp.save`` on a
   process group would pickle), the plan kept while no rank's changes
   (:mod:`ckptvault.distributed.plan_cache`): a sharded tensor is written by the
   ranks holding its shards and a replicated one once; every rank but 0 writes its
   own index (format 3); the write results (file records, digests, wrapped keys,
   each index's size and digest) reach the coordinator, and an error on any rank
   raises on all;
4. every rank's own state tree (RNGs, loaders: :mod:`ckptvault.state.ranks`), its
   file names and outcome are gathered;
5. the coordinator writes the state and its own index, reads back and checks every
   other rank's index (:mod:`ckptvault.distributed.rank_index`), builds, signs and
   publishes the manifest, and broadcasts the outcome, which every rank returns or
   raises.

When any rank fails, nothing is published: each rank removes its own files, the
coordinator the whole attempt, and every rank raises the same
:class:`~ckptvault.errors.SaveFailedError` naming the ranks that failed. A rank that
died makes the others' next collective raise
:class:`~ckptvault.errors.CollectiveError` after ``collective_timeout_s``; a rank that
had already handed its files to rank 0 then keeps them, since rank 0 may have
published them before it died (:meth:`CollectiveSave._give_up`).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ckptvault.distributed import messages
from ckptvault.distributed.dcp_save import write_tensors_together
from ckptvault.distributed.plan_cache import SavePlanCache
from ckptvault.distributed.rank_index import SaveIndexes, root_indexes
from ckptvault.distributed.replicas import Disagreement, disagreements, replica_digests
from ckptvault.distributed.wire import MAX_ERROR_CHARS
from ckptvault.errors import CheckpointError, PeerMessageError, SaveFailedError
from ckptvault.format.index import IndexRecord
from ckptvault.format.layout import encrypted_state_file_name, new_generation_id
from ckptvault.format.manifest import INDEXED_SINCE_FORMAT
from ckptvault.io.writer import VaultStorageWriter, files_per_rank
from ckptvault.saving.generation_writer import (
    MANIFEST_ALLOWANCE,
    METADATA_PER_TENSOR,
    WrittenGeneration,
    save_stages,
)
from ckptvault.state.capture import CapturedState
from ckptvault.state.ranks import compose
from ckptvault.storage.base import StagingArea
from ckptvault.storage.listing import GenerationInfo

if TYPE_CHECKING:
    from ckptvault.saving.generation_writer import GenerationWriter

logger = logging.getLogger("ckptvault")


class CollectiveSave:
    """The phases of one multi-rank save (see the module docstring)."""

    def __init__(self, writer: GenerationWriter) -> None:
        self.writer = writer
        self.coordinator = writer.coordinator
        self.store = writer.store
        # The plan of this writer's saves, kept while the structure is unchanged:
        # what a save staged in it counts once every rank knows the save succeeded.
        self.plans = SavePlanCache()

    def write(
        self, step: int, captured: CapturedState, metrics: dict[str, int | float] | None
    ) -> WrittenGeneration:
        started = time.perf_counter()
        try:
            written = self._write(step, captured, metrics, started)
        except BaseException:
            self.plans.forget()  # on every rank alike: the next save plans afresh
            raise
        self.plans.commit()
        return written

    def _write(
        self,
        step: int,
        captured: CapturedState,
        metrics: dict[str, int | float] | None,
        started: float,
    ) -> WrittenGeneration:
        generation_id = self._begin(captured)
        area: StagingArea | None = None
        handed_over = False  # this rank's files are in rank 0's hands: it may publish them
        indexes = (
            SaveIndexes(self.writer.run_id, generation_id)
            if self.writer.format_version >= INDEXED_SINCE_FORMAT
            else None
        )
        try:
            area = self._join(generation_id)
            tensors = self._write_tensors(area, generation_id, captured, indexes)
            # A memory tier on several nodes: the files go to rank 0's node first
            # (ckptvault.memory.nodes); a failure raises on every rank alike.
            ship = getattr(self.store, "ship_to_coordinator", None)
            if ship is not None:
                ship(area, tensors.own_files)
            handed_over = True
            gathered = self._gather(captured, tensors)
            mismatches = self._check_replicas(gathered, step)
            state = {"global": captured.tree, "ranks": gathered}
            publishing = time.perf_counter()
            outcome = self._publish(area, step, generation_id, state, tensors, metrics, indexes)
        except BaseException as exc:
            if area is not None:
                self._give_up(area, handed_over and not isinstance(exc, SaveFailedError))
            raise
        # This rank's view: its own files' fsync; "publish" includes agreeing on it.
        stages = save_stages(started, publishing, time.perf_counter(), tensors.commit_seconds)
        if not self.coordinator.is_coordinator:
            area.release()  # rank 0 published it; the files are the generation's now
        info = GenerationInfo(
            step, generation_id, outcome["location"], outcome["bytes"], outcome["created_at"]
        )
        self.writer.parent = generation_id
        return WrittenGeneration(
            info,
            time.perf_counter() - started,
            tensors.reused_plan,
            outcome.get("kek_id"),
            tuple(mismatches),
            stages=stages,
        )

    def _give_up(self, area: StagingArea, outcome_unknown: bool) -> None:
        """Abort this rank's part of a failed save, removing what it wrote, unless the
        outcome is unknown to a rank other than the coordinator: once its files were
        handed over (phase 4 on), rank 0 may have published them and then died or
        stalled (a ``CollectiveError`` here), and removing them would break a published
        generation. They are kept then: the generation's files, or a staging leftover
        that the next save removes. A ``SaveFailedError`` is every rank's verdict that
        nothing was published."""
        if outcome_unknown and not self.coordinator.is_coordinator:
            area.release()
        else:
            area.abort()

    # -- phases --------------------------------------------------------------------------

    _area: StagingArea  # the coordinator's, from phase 1

    def _begin(self, captured: CapturedState) -> str:
        """Phase 1: the coordinator's generation id, on every rank."""
        message: dict[str, Any] = {}
        if self.coordinator.is_coordinator:
            try:
                if self.writer.clean_staging:  # a writer process's trainer cleans instead
                    self.store.remove_stale_staging()
                world = self.coordinator.world_size
                tensor_bytes = sum(t.numel() * t.element_size() for t in captured.tensors.values())
                metadata = MANIFEST_ALLOWANCE + METADATA_PER_TENSOR * len(captured.tensors)
                # A rough bound: every rank holds about as much as this one.
                self.store.check_capacity(
                    world * tensor_bytes + metadata, world * self.writer.settings.threads + 4
                )
                cutoff = self.writer.newest_rollback_cutoff()
                message = {"id": new_generation_id(not_before=cutoff)}
                self._area = self.store.begin_generation(message["id"])
            except (CheckpointError, OSError) as exc:
                message = {"error": f"{type(exc).__name__}: {exc}"}
        message = self.coordinator.broadcast(message)
        if "error" in message:
            raise SaveFailedError(f"rank 0 could not begin the save: {message['error']}")
        generation_id: str = message["id"]
        return generation_id

    def _join(self, generation_id: str) -> StagingArea:
        """Phase 2: every rank holds the attempt's staging area."""
        area: StagingArea | None = None
        error = None
        if self.coordinator.is_coordinator:
            area = self._area
        else:
            try:
                area = self.store.join_generation(generation_id)
            except (CheckpointError, OSError) as exc:
                error = f"{type(exc).__name__}: {exc}"
        try:
            self._all_succeeded("joining the staging area", error)
        except BaseException:
            if area is not None:
                area.abort()
            raise
        assert area is not None
        return area

    def _write_tensors(
        self,
        area: StagingArea,
        generation_id: str,
        captured: CapturedState,
        indexes: SaveIndexes | None,
    ) -> VaultStorageWriter:
        """Phase 3: DCP's planner, collectively over ckptvault's own JSON collectives
        (never DCP's pickled ones), the plan reused while no rank's changed; every rank
        but 0 writes its index. A failure anywhere raises on every rank."""
        settings = self.writer.settings
        return write_tensors_together(
            captured.tensors,
            area,
            settings.chunk_size,
            files_per_rank(settings.threads, self.coordinator.world_size),
            self.writer.encryption(generation_id),
            self.coordinator,
            self.plans,
            indexes,
            self.writer.on_bytes,
        )

    def _gather(self, captured: CapturedState, tensors: VaultStorageWriter) -> list[Any]:
        """Phase 4: every rank's own state tree, file names and replica digests, on
        every rank."""
        mine: dict[str, Any] = {"tree": captured.rank_tree or {}, "files": tensors.own_files}
        if self.writer.settings.on_replica_mismatch != "ignore":
            mine["digests"] = replica_digests(captured.tensors, self.coordinator.rank)
        try:
            gathered = self.coordinator.all_gather(mine)
            world = self.coordinator.world_size
            return [messages.rank_part(raw, rank, world) for rank, raw in enumerate(gathered)]
        except PeerMessageError as exc:
            # Every rank received the same bytes and raises here alike: rank 0 cannot
            # have published, so each rank may remove its files (SaveFailedError).
            raise SaveFailedError(f"{exc}. Nothing was published") from exc

    def _check_replicas(self, gathered: list[Any], step: int) -> list[Disagreement]:
        """Replicas whose bytes differ (every rank reaches the same verdict); with
        ``on_replica_mismatch="raise"`` the save fails on every rank."""
        found = disagreements([entry.pop("digests", {}) for entry in gathered])
        if not found:
            return []
        named = "; ".join(d.describe() for d in found[:5])
        message = (
            f"replicas of {len(found)} tensor slot(s) differ between ranks at step {step} "
            f"({named}{'; ...' if len(found) > 5 else ''}): silent data corruption on the "
            "ranks in the smaller group is likely"
        )
        if self.writer.settings.on_replica_mismatch == "raise":
            raise SaveFailedError(f"{message}. Nothing was published (on_replica_mismatch='raise')")
        if self.coordinator.is_coordinator:
            logger.warning("%s; the generation is published with rank 0's copy", message)
        return found

    def _publish(
        self,
        area: StagingArea,
        step: int,
        generation_id: str,
        gathered: dict[str, Any],
        tensors: VaultStorageWriter,
        metrics: dict[str, int | float] | None,
        indexes: SaveIndexes | None,
    ) -> dict[str, Any]:
        """Phase 5: the coordinator publishes; every rank learns the outcome."""
        outcome: dict[str, Any] = {}
        if self.coordinator.is_coordinator:
            try:
                outcome = self._build_and_publish(
                    area, step, generation_id, gathered, tensors, metrics, indexes
                )
            except (CheckpointError, OSError) as exc:
                outcome = {"error": f"{type(exc).__name__}: {exc}"}
        outcome = self.coordinator.broadcast(outcome)
        if "error" in outcome:
            raise SaveFailedError(
                f"rank 0 could not publish generation {generation_id} (step {step}): "
                f"{outcome['error']}. Nothing was published"
            )
        return outcome

    def _build_and_publish(
        self,
        area: StagingArea,
        step: int,
        generation_id: str,
        gathered: dict[str, Any],
        tensors: VaultStorageWriter,
        metrics: dict[str, int | float] | None,
        indexes: SaveIndexes | None,
    ) -> dict[str, Any]:
        """The coordinator's part of phase 5: the other ranks' files adopted, the
        composite state written, (format 3) its own index written and every other
        rank's checked, the manifest built, signed and published."""
        ranks = gathered["ranks"]
        area.adopt([name for entry in ranks[1:] for name in entry["files"]])
        composite = compose(gathered["global"], [entry["tree"] for entry in ranks])
        state = self.writer.write_state(area, generation_id, CapturedState(composite), tensors)
        listed = None
        if indexes is not None:
            listed = (self._indexes(area, indexes, tensors), indexes.table)
        manifest = self.writer.build_manifest(
            step, generation_id, state, tensors, area, metrics, indexes=listed
        )
        manifest_bytes = manifest.to_bytes()
        ref = area.publish(step, manifest_bytes, self.writer.trust.sign_manifest(manifest_bytes))
        return {
            "location": ref.location,
            "bytes": manifest.stored_bytes,
            "created_at": manifest.created_at,
            "kek_id": manifest.encryption.kek_id if manifest.encryption else None,
        }

    def _indexes(
        self, area: StagingArea, indexes: SaveIndexes, tensors: VaultStorageWriter
    ) -> dict[str, IndexRecord]:
        """Every index the root lists: rank 0's, over its tensor files and (encrypted)
        its state file, and every other rank's once checked."""
        own = dict(indexes.own_records)
        state_file = encrypted_state_file_name(0)
        if state_file in tensors.file_records:
            own[state_file] = tensors.file_records[state_file]
        return root_indexes(
            area, indexes, own, tensors.file_records, self.writer.settings.chunk_size
        )

    # -- helpers -------------------------------------------------------------------------

    def _all_succeeded(self, what: str, error: str | None) -> None:
        """Gather every rank's outcome of ``what``; raise the same error on every rank
        when any failed, naming those ranks."""
        outcomes = self.coordinator.all_gather(None if error is None else error[:MAX_ERROR_CHARS])
        failed = [
            (rank, message)
            for rank, raw in enumerate(outcomes)
            if (message := messages.outcome(raw, rank, what))
        ]
        if failed:
            named = "; ".join(f"rank {rank}: {message}" for rank, message in failed)
            raise SaveFailedError(
                f"{what} failed on {len(failed)} rank(s) ({named}). Nothing was published"
            )
