"""``ckptvault.dcp.StorageWriter``: plain ``dcp.save``/``dcp.async_save`` into a
ckptvault store, published atomically, hashed, optionally signed and encrypted.

How one save runs through DCP's protocol (one rank or many):

1. ``prepare_local_plan`` (every rank): refuses a plan DCP's plan caching reused.
2. ``prepare_global_plan`` (the coordinator): takes the store's writer lock, removes
   leftovers of crashed saves, checks free space, draws the generation id and begins
   the staging area; the id reaches every rank in its plan's ``storage_data``.
3. ``write_data`` (every rank): encodes its non-tensor items (``BYTE_IO``: an
   optimizer's hyperparameters, counters, strings) as JSON, never pickled, refusing
   a value JSON cannot hold before writing anything (:mod:`ckptvault.dcp.objects`);
   then joins the staging area and writes its tensors as hashed, fsync'd
   safetensors files named after its rank
   (:class:`~ckptvault.io.writer.VaultStorageWriter`). The file records, chunk
   locations and encoded values travel back to the coordinator in DCP's write
   results.
4. ``finish`` (the coordinator): one manifest over every rank's files, with the
   values in its state tree, signed, published atomically
   (:mod:`ckptvault.dcp.publish`); the lock is released.

Whenever a step fails, nothing is published: the failing rank removes what it wrote
(the coordinator: the whole attempt), DCP raises on every rank, and whatever a
failure elsewhere left in the staging area is removed by this writer's next save,
its :meth:`StorageWriter.close`, its garbage collection, or any later save's cleanup.

With ``ledger=`` every publish is recorded in the run's ledger and audit log, as the
manager records its own (:mod:`ckptvault.dcp.records`): a reader with the same
ledger then notices a published generation that vanished from the store.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import time
import weakref
from typing import Any, NoReturn

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter as DCPStorageWriter
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ckptvault.config import validate_step
from ckptvault.dcp._common import (
    KeystoreLike,
    StoreURL,
    check_run_id,
    open_plugin_store,
    plugin_trust,
    portable,
)
from ckptvault.dcp._typed import install
from ckptvault.dcp.objects import encode_objects, objects_tree, split_results
from ckptvault.dcp.publish import SaveSettings, publish_generation
from ckptvault.dcp.records import PluginRecords
from ckptvault.errors import StoreLockedError, UsageError
from ckptvault.format.container import DEFAULT_SEGMENT_SIZE
from ckptvault.format.layout import is_generation_id, new_generation_id
from ckptvault.io.writer import VaultStorageWriter, default_threads
from ckptvault.saving.generation_writer import MANIFEST_ALLOWANCE, METADATA_PER_TENSOR
from ckptvault.storage.base import StagingArea, Store
from ckptvault.storage.listing import GenerationInfo
from ckptvault.trust.digests import DEFAULT_CHUNK_SIZE
from ckptvault.trust.envelope import FileEncryption
from ckptvault.trust.signing import PrivateKeyLike

PLAN_CACHING_REFUSED = (
    "DCP's plan caching (DefaultSavePlanner(enable_plan_caching=True)) reuses the previous "
    "save's plans, and with them the previous save's generation; ckptvault.dcp.StorageWriter "
    "needs a fresh plan per save. Create the planner without enable_plan_caching"
)


@dataclasses.dataclass(frozen=True)
class Attempt:
    """A plan's ``storage_data``: the save attempt the coordinator began."""

    generation_id: str


class _Pending:
    """The coordinator's unfinished attempt: its staging area and the writer lock.
    Kept apart from the writer so that a finalizer can clean up after a writer
    dropped mid-save (DCP never calls ``finish`` when a rank failed)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.area: StagingArea | None = None

    def abandon(self) -> None:
        """Remove the unfinished attempt and release the lock; idempotent."""
        area, self.area = self.area, None
        try:
            if area is not None:
                area.abort()
        finally:
            self.store.release_writer()


class StorageWriter(DCPStorageWriter):
    """A DCP ``StorageWriter`` that saves into a ckptvault store (path, ``file://``,
    ``s3://`` or ``az://`` URL) as one atomically published generation of ``step``.

    Contract: a ``dcp.save`` either publishes one complete generation of run
    ``run_id`` (manifest with per-chunk BLAKE3 digests of every rank's files; signed
    when ``signing_key`` is given; encrypted with the run's key when ``keystore`` is
    given) or publishes nothing and raises on every rank (ckptvault's own error,
    out of plain ``dcp.save``). Non-tensor values are stored as JSON in the
    generation, never pickled; a value JSON cannot hold is refused before anything
    is published. One writer object per save (``step`` is fixed); construct it on every
    rank. The store's writer lock is held by the coordinator from planning to
    publish, so a ``CheckpointManager`` writing the same store at the same time is
    refused (``StoreLockedError``). After a successful save, :attr:`published` (on
    the coordinator) describes the generation. ``ledger`` (a path outside the store;
    ``audit_log`` defaults beside it): the publish is recorded there, as the
    manager's are, for readers that check the run's floor and published table.
    """

    def __init__(
        self,
        url: StoreURL,
        *,
        run_id: str,
        step: int,
        signing_key: PrivateKeyLike | None = None,
        keystore: KeystoreLike | None = None,
        s3_endpoint_url: str | None = None,
        threads: int | None = None,
        ledger: StoreURL | None = None,
        audit_log: StoreURL | None = None,
    ) -> None:
        super().__init__()
        install(StorageWriter)  # plain dcp.save raises ckptvault's errors, not DCP's wrapper
        self.run_id = check_run_id(run_id)
        self.step = validate_step(step)
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise UsageError(f"threads must be a positive int, got {threads!r}")
        self.store = open_plugin_store(url, s3_endpoint_url, must_exist=False)
        self.trust = plugin_trust(
            self.store,
            signing_key=signing_key,
            keystore=keystore,
            ledger=ledger,
            audit_log=audit_log,
        )
        self.trust.ensure_key_usable(self.run_id)
        self._records = PluginRecords(self.trust, self.store, self.run_id)
        self.settings = SaveSettings(
            self.run_id, self.step, DEFAULT_CHUNK_SIZE, DEFAULT_SEGMENT_SIZE,
            threads or default_threads(),
        )  # fmt: skip
        self.rank = 0
        self.is_coordinator = True
        self.published: GenerationInfo | None = None
        self._written: VaultStorageWriter | None = None
        self._pending = _Pending(self.store)
        weakref.finalize(self, self._pending.abandon)

    def __getstate__(self) -> NoReturn:
        raise UsageError(
            "ckptvault.dcp.StorageWriter holds a store lock and keys and is not copied to "
            "other processes; use dcp.async_save's default thread-based checkpointer "
            "(not AsyncCheckpointerType.PROCESS)"
        )

    # -- DCP protocol ----------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP calls this when ``checkpoint_id`` is given; the store and step given at
        construction decide where the save goes, so it only drops an unfinished
        attempt of this writer."""
        self.close()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise UsageError(
                "dcp.save(use_collectives=False) writes per-rank checkpoints without a "
                "coordinator; ckptvault publishes one generation for the whole job: save "
                "with use_collectives=True (the default)"
            )
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not plan.usable:
            raise UsageError(PLAN_CACHING_REFUSED)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """The coordinator begins the attempt and hands its id to every rank."""
        if not all(plan.usable for plan in plans):
            raise UsageError(PLAN_CACHING_REFUSED)
        self.close()  # an attempt a failed earlier save of this writer left behind
        self.published = None
        try:
            area = self._begin(plans)
        except BaseException as exc:
            raise portable(exc) from exc
        attempt = Attempt(area.generation_id)
        return [dataclasses.replace(plan, storage_data=attempt) for plan in plans]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Encode this rank's non-tensor values, then write its tensors into the
        attempt's staging area; on failure remove them (the coordinator: the whole
        attempt) and raise."""
        area: StagingArea | None = None
        try:
            generation_id = _attempt_id(plan, planner)
            objects = [item for item in plan.items if item.type == WriteItemType.BYTE_IO]
            encoded = encode_objects(objects, planner)  # refuses before anything is written
            if objects:
                tensors = [item for item in plan.items if item.type != WriteItemType.BYTE_IO]
                plan = dataclasses.replace(plan, items=tensors)
            area = self._area_for(generation_id)
            written = VaultStorageWriter(
                area,
                self.settings.chunk_size,
                self.settings.threads,
                self._encryption(generation_id),
                rank=self.rank,
            )
            future = written.write_data(plan, planner)
            future.wait()
            results: list[WriteResult] = future.value() + encoded
        except BaseException as exc:
            if self.is_coordinator:
                self._pending.abandon()
            elif area is not None:
                area.abort()
            raise portable(exc) from exc
        if not self.is_coordinator:
            _release_joined(area)
        self._written = written
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The coordinator, once every rank wrote: manifest, signature, publish."""
        area, written = self._pending.area, self._written
        try:
            if area is None or written is None:
                raise UsageError("finish() without a save in progress on this writer")
            tensors, tensor_results, values = split_results(metadata, results)
            written.finish(tensors, tensor_results)
            metadata.storage_data = tensors.storage_data
            started = time.perf_counter()
            published = publish_generation(
                area,
                written,
                self.settings,
                self.trust,
                world_size=len(results),
                tree=objects_tree(values),
            )
            self._pending.area = None  # published: nothing left to remove
            self.published = published.info
            # After the publish: a failure to record it says so (the generation exists).
            self._records.published(published.info, time.perf_counter() - started, published.kek_id)
        except BaseException as exc:
            raise portable(exc) from exc
        finally:
            self._written = None
            self._pending.abandon()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen from a checkpoint_id: construct it with the store URL

    def storage_meta(self) -> None:
        return None

    # -- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Remove an attempt this writer began but did not publish (a save that failed
        on another rank) and release the store's writer lock. Idempotent."""
        self._written = None
        self._pending.abandon()

    # -- helpers ---------------------------------------------------------------------------

    def _begin(self, plans: list[SavePlan]) -> StagingArea:
        """Lock, clean up, check capacity, begin the staging area (the coordinator)."""
        try:
            self.store.acquire_writer()
        except StoreLockedError:
            # A writer dropped after a failed save may still hold the lock, kept alive
            # by the reference cycle DCP's exception makes; collecting it runs its
            # finalizer, which releases the lock. A live writer keeps it.
            gc.collect()
            self.store.acquire_writer()
        try:
            self.store.remove_stale_staging()
            items = [item for plan in plans for item in plan.items]
            nbytes = sum(item.tensor_storage_size() or 0 for item in items)
            metadata = MANIFEST_ALLOWANCE + METADATA_PER_TENSOR * len(items)
            self.store.check_capacity(nbytes + metadata, len(plans) * self.settings.threads + 4)
            # After the run's latest rollback cutoff, or the rollback abandons it.
            cutoff = self._records.newest_cutoff()
            self._pending.area = self.store.begin_generation(new_generation_id(not_before=cutoff))
        except BaseException:
            self._pending.abandon()
            raise
        return self._pending.area

    def _area_for(self, generation_id: str) -> StagingArea:
        if not self.is_coordinator:
            return self.store.join_generation(generation_id)
        area = self._pending.area
        if area is None or area.generation_id != generation_id:
            raise UsageError(
                f"the save plan names attempt {generation_id}, which this coordinator did "
                "not begin (a planner that reuses old plans?)"
            )
        return area

    def _encryption(self, generation_id: str) -> FileEncryption | None:
        keystore = self.trust.keystore
        if keystore is None:
            return None
        return FileEncryption(keystore, self.run_id, generation_id, self.settings.segment_size)


def _attempt_id(plan: SavePlan, planner: SavePlanner) -> str:
    """The generation id the coordinator handed this rank, checked."""
    if getattr(planner, "_enable_plan_caching", False):
        raise UsageError(PLAN_CACHING_REFUSED)
    attempt = plan.storage_data
    if not isinstance(attempt, Attempt) or not is_generation_id(attempt.generation_id):
        raise UsageError(
            "the save plan does not carry ckptvault's save attempt: the planner dropped "
            "the plan's storage_data, or reused an old plan"
        )
    return attempt.generation_id


def _release_joined(area: StagingArea | None) -> None:
    """Close a joined staging area's handles without removing its files (the
    coordinator publishes them). The POSIX area holds directory descriptors that
    would otherwise stay open until exit, two per save."""
    if area is not None:
        area.release()
