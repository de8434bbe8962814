"""One save attempt, start to finish: captured state -> a published generation.

Steps, in order: remove staging leftovers of crashed saves; open a staging area
under a fresh generation id; write every tensor through DCP (hashed, optionally
encrypted, fsync'd); build the manifest over every file; sign its exact bytes;
publish atomically by the store's rule; tell the event subscribers. Any failure
before publish aborts the staging area, so nothing becomes visible and earlier
generations are untouched.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ckptvault._version import __version__
from ckptvault.errors import KeyUnavailableError, UsageError
from ckptvault.events import Published, ReplicasDisagree, SaveFailed
from ckptvault.format.container import CIPHER
from ckptvault.format.index import IndexRecord
from ckptvault.format.layout import (
    encrypted_state_file_name,
    generation_created_at,
    new_generation_id,
)
from ckptvault.format.manifest import FORMAT_VERSION, INDEXED_SINCE_FORMAT, Manifest
from ckptvault.format.records import EncryptionSection
from ckptvault.format.tensor_table import TensorTable
from ckptvault.io.dcp_io import write_tensors
from ckptvault.io.direct_write import DirectWriter
from ckptvault.io.planners import forget_cached_plans
from ckptvault.io.state_file import ENCRYPTED_STATE_TAG, write_state_file
from ckptvault.io.writer import VaultStorageWriter
from ckptvault.run_context import RunContext
from ckptvault.saving.indexes import IndexWriter
from ckptvault.saving.save_watch import SaveWatcher, watched
from ckptvault.state.capture import CapturedState
from ckptvault.storage.base import StagingArea
from ckptvault.storage.listing import GenerationInfo
from ckptvault.trust.envelope import FileEncryption
from ckptvault.trust.manifest_auth import seal_manifest

logger = logging.getLogger("ckptvault")

# Manifest, headers and state JSON, estimated generously: a base plus some per tensor.
MANIFEST_ALLOWANCE = 64 * 1024
METADATA_PER_TENSOR = 1024


@dataclass(frozen=True)
class WriteSettings:
    threads: int
    chunk_size: int  # bytes per digest chunk
    segment_size: int  # plaintext bytes per encrypted segment
    on_replica_mismatch: str = "warn"  # many ranks: "warn", "raise" or "ignore"


@dataclass(frozen=True)
class WrittenGeneration:
    info: GenerationInfo
    seconds: float
    reused_plan: bool  # DCP reused the previous save's plan
    kek_id: str | None = None  # the run key that wraps its file keys, when encrypted
    # Many ranks: replicated tensors whose replicas differed (ckptvault.distributed.replicas).
    replica_mismatches: tuple[Any, ...] = ()
    # Seconds per stage ("write", "fsync", "publish"; the scheduler adds "stage"), and
    # what the scheduler knows of the whole save (see ckptvault.events.Published).
    stages: dict[str, float] = field(default_factory=dict)
    stall_seconds: float = 0.0
    total_seconds: float = 0.0
    metrics: dict[str, int | float] | None = None


class CollectiveWrite(Protocol):
    """One save of a job of several ranks (:class:`~ckptvault.distributed.save.CollectiveSave`,
    handed in by whoever builds the writer: the multi-rank path sits above this one)."""

    def write(
        self, step: int, captured: CapturedState, metrics: dict[str, int | float] | None
    ) -> WrittenGeneration: ...


class GenerationWriter:
    """Writes and publishes generations of one run into one store.

    ``collective`` builds the save of a job of several ranks around this writer; a
    writer without one refuses a coordinator of more than one rank."""

    # The manifest format written; older ones (1, 2) only by tests of old generations.
    format_version: int = FORMAT_VERSION

    def __init__(
        self,
        run: RunContext,
        contract: dict[str, Any],
        settings: WriteSettings,
        collective: Callable[[GenerationWriter], CollectiveWrite] | None = None,
    ) -> None:
        self.collective = collective
        self._collective: CollectiveWrite | None = None  # built at the first collective save
        self.store = run.store
        self.run_id = run.run_id
        self.trust = run.trust
        self.coordinator = run.coordinator
        self.events = run.events
        self.contract = contract
        self.settings = settings
        self.parent: str | None = None  # the generation last saved or restored
        self._plan_cache_key = secrets.token_hex(8)
        self._direct = DirectWriter()  # one process: no DCP planning, the layout kept
        self._indexes = IndexWriter()  # format 3: the per-rank indexes, before the root
        # False in a writer process: the training process holds the writer lock and
        # removes staging leftovers before each save it sends (saving.writer_process).
        self.clean_staging = True
        self.watcher: SaveWatcher | None = None  # told as saves write (saving.save_watch)

    def watch(self, watcher: SaveWatcher | None) -> None:
        """Tell ``watcher`` when each save starts and ends and what it writes (a hang
        watchdog's progress: :mod:`ckptvault.saving.save_watch`)."""
        self.watcher = watcher

    @property
    def on_bytes(self) -> Callable[[int], None] | None:
        """What a save's writers tell each piece of bytes written (None: nobody)."""
        return self.watcher.wrote if self.watcher is not None else None

    def write(
        self,
        step: int,
        captured: CapturedState,
        metrics: dict[str, int | float] | None = None,
    ) -> WrittenGeneration:
        """Write, sign and publish one generation (the caller holds the writer lock);
        ``metrics`` (validated) go into the manifest. In a job of several ranks this
        is collective (:mod:`ckptvault.distributed.save`). The watcher, if any, is
        told the save's bytes as they are written."""
        with watched(self.watcher):
            return self._write(step, captured, metrics)

    def _write(
        self, step: int, captured: CapturedState, metrics: dict[str, int | float] | None
    ) -> WrittenGeneration:
        if self.coordinator.world_size > 1:
            if self.collective is None:
                raise UsageError(
                    f"a job of {self.coordinator.world_size} ranks saves collectively, but this "
                    "writer was built without a collective save: build it through "
                    "CheckpointManager"
                )
            # One for the writer's life: it keeps the plan between saves.
            if self._collective is None:
                self._collective = self.collective(self)
            return self._collective.write(step, captured, metrics)
        started = time.perf_counter()
        if self.clean_staging:
            self.store.remove_stale_staging()
        tensor_bytes = sum(t.numel() * t.element_size() for t in captured.tensors.values())
        # Manifest, signature, state file and one tensor file per writer thread at most.
        metadata = MANIFEST_ALLOWANCE + METADATA_PER_TENSOR * len(captured.tensors)
        self.store.check_capacity(tensor_bytes + metadata, self.settings.threads + 4)
        generation_id = new_generation_id(not_before=self.newest_rollback_cutoff())
        staging = self.store.begin_generation(generation_id)
        try:
            tensors = self._write_tensors(staging, generation_id, captured)
            state = self.write_state(staging, generation_id, captured, tensors)
            manifest = self.build_manifest(step, generation_id, state, tensors, staging, metrics)
            manifest_bytes = manifest.to_bytes()
            signature = self.trust.sign_manifest(manifest_bytes)
            publishing = time.perf_counter()
            ref = staging.publish(step, manifest_bytes, signature)
        except BaseException:
            staging.abort()
            raise
        self.parent = generation_id
        published = time.perf_counter()
        info = GenerationInfo(
            step, generation_id, ref.location, manifest.stored_bytes, manifest.created_at
        )
        kek_id = manifest.encryption.kek_id if manifest.encryption else None
        stages = save_stages(started, publishing, published, tensors.commit_seconds)
        return WrittenGeneration(
            info, published - started, tensors.reused_plan, kek_id, stages=stages
        )

    def announce(self, written: WrittenGeneration) -> None:
        """Tell the subscribers a generation was published (once per job: the
        coordinator). Separate from :meth:`write` so that a subscriber's failure
        is never mistaken for a failed save: the generation exists either way."""
        if not self.coordinator.is_coordinator:
            return
        info = written.info
        self.events.emit(
            Published(
                run_id=self.run_id,
                store=self.store.location,
                step=info.step,
                generation_id=info.generation_id,
                location=info.path,
                bytes=info.bytes,
                seconds=written.seconds,
                signer=self.trust.signer_id,
                kek_id=written.kek_id,
                stall_seconds=written.stall_seconds,
                total_seconds=written.total_seconds,
                stages=written.stages,
                metrics=written.metrics,
                contract=self.contract,
            )
        )
        if written.replica_mismatches:
            self.events.emit(
                ReplicasDisagree(
                    run_id=self.run_id,
                    store=self.store.location,
                    step=info.step,
                    generation_id=info.generation_id,
                    slots=[d.to_json() for d in written.replica_mismatches],
                )
            )

    def announce_failure(
        self, step: int, error: BaseException, stall_seconds: float, total_seconds: float
    ) -> None:
        """Tell the subscribers a save failed after it was accepted (the coordinator's
        view: once per job). The save's own error matters more than its record: a
        subscriber's failure is logged, never raised over it."""
        if not self.coordinator.is_coordinator:
            return
        reason = str(error).splitlines()[0][:2000] if str(error) else type(error).__name__
        event = SaveFailed(
            run_id=self.run_id,
            store=self.store.location,
            step=step,
            error=type(error).__name__,
            reason=reason,
            stall_seconds=stall_seconds,
            total_seconds=total_seconds,
        )
        try:
            self.events.emit(event)
        except Exception as failure:
            logger.error("%s, and recording the failure failed too: %s", event.summary, failure)

    def close(self) -> None:
        forget_cached_plans(self._plan_cache_key)
        # The collective save refers back to this writer: a cycle that would keep the
        # coordinator's gloo group alive until the interpreter's own teardown, where
        # torch 2.13 can abort ("terminate called without an active exception").
        self._collective = None

    def newest_rollback_cutoff(self) -> str | None:
        """New ids must sort after the run's latest rollback cutoff, even when this
        clock is behind the machine that rolled back: otherwise the new generation
        would count as abandoned by that rollback. Read per save (one SQLite read)."""
        floor = self.trust.floor(self.run_id)  # None without a ledger
        return floor.newest_cutoff if floor is not None else None

    def encryption(self, generation_id: str) -> FileEncryption | None:
        keystore = self.trust.keystore
        if keystore is None:
            return None
        return FileEncryption(keystore, self.run_id, generation_id, self.settings.segment_size)

    def _write_tensors(
        self, staging: StagingArea, generation_id: str, captured: CapturedState
    ) -> VaultStorageWriter:
        return write_tensors(
            captured.tensors,
            staging,
            self.settings.chunk_size,
            self.settings.threads,
            self.encryption(generation_id),
            plan_cache_key=self._plan_cache_key,
            rank=self.coordinator.rank,
            direct=self._direct,
            indexed=self.format_version >= INDEXED_SINCE_FORMAT,
            on_bytes=self.on_bytes,
        )

    def write_state(
        self,
        staging: StagingArea,
        generation_id: str,
        captured: CapturedState,
        tensors: VaultStorageWriter,
    ) -> dict[str, Any]:
        """The manifest's ``state``: the tree itself, or (encrypted runs) a reference to
        the encrypted state file written here, whose record and key join the tensors'."""
        encryption = self.encryption(generation_id)
        if encryption is None:
            return captured.tree
        name = encrypted_state_file_name(self.coordinator.rank)
        record, wrapped = write_state_file(
            staging, name, captured.tree, self.settings.chunk_size, encryption
        )
        tensors.file_records[name] = record
        tensors.wrapped_keys[name] = wrapped
        return {ENCRYPTED_STATE_TAG: name}

    def build_manifest(
        self,
        step: int,
        generation_id: str,
        state: dict[str, Any],
        tensors: VaultStorageWriter,
        staging: StagingArea,
        metrics: dict[str, int | float] | None = None,
        indexes: tuple[dict[str, IndexRecord], TensorTable | None] | None = None,
    ) -> Manifest:
        """The manifest, its indexes written into ``staging`` first (format 3: the
        root covers them); an encrypted one sealed with a MAC under a fresh key that
        only the run's KEK unwraps (``ckptvault.trust.manifest_auth``). ``indexes``:
        the indexes written already (by the ranks of a collective save) and the
        root's tensor table, rather than indexes written here."""
        encryption = self.encryption(generation_id)
        section, mac_key = None, None
        if encryption is not None:
            mac_key, kek_id, wrapped_mac_key = encryption.new_manifest_key()
            section = encryption_section(
                tensors.wrapped_keys, self.settings.segment_size, (kek_id, wrapped_mac_key)
            )
        manifest = Manifest(
            run_id=self.run_id,
            step=step,
            generation_id=generation_id,
            created_at=generation_created_at(generation_id),
            parent=self.parent,
            chunk_size=self.settings.chunk_size,
            files=tensors.file_records,
            dcp=tensors.dcp_json or {},
            state=state,
            contract=self.contract,
            writer={"ckptvault": __version__, "world_size": self.coordinator.world_size},
            encryption=section,
            format_version=self.format_version,
            metrics=metrics,
            encoded_dcp=(
                (tensors.dcp_json, tensors.dcp_bytes)
                if tensors.dcp_json is not None and tensors.dcp_bytes is not None
                else None
            ),
        )
        if indexes is None:
            manifest = self._indexes.write(staging, manifest, tensors.index_plan)
        else:
            manifest = dataclasses.replace(manifest, indexes=indexes[0], tensor_table=indexes[1])
        return manifest if mac_key is None else seal_manifest(manifest, mac_key)


def save_stages(
    started: float, publishing: float, published: float, commit_seconds: dict[str, float]
) -> dict[str, float]:
    """A save's ``write``, ``fsync`` and ``publish`` seconds from the ``perf_counter``
    readings at its start, before publishing and after, and each file's commit time.
    Files are made durable in parallel, so the slowest commit is what fsync cost; it
    is part of the time before publishing, which ``write`` is the rest of."""
    fsync = min(max(commit_seconds.values(), default=0.0), publishing - started)
    return {
        "write": publishing - started - fsync,
        "fsync": fsync,
        "publish": published - publishing,
    }


def encryption_section(
    wrapped_keys: dict[str, tuple[str, bytes]],
    segment_size: int,
    wrapped_mac_key: tuple[str, bytes],
) -> EncryptionSection:
    """The manifest's encryption section from each file's (KEK id, wrapped data key)
    and the manifest MAC key's (KEK id, wrapped key); the MAC itself is added by
    ``seal_manifest``."""
    kek_ids = {kek for kek, _ in wrapped_keys.values()} | {wrapped_mac_key[0]}
    if len(kek_ids) > 1:
        raise KeyUnavailableError(
            f"files of one generation were wrapped by different keys ({sorted(kek_ids)}): the "
            "key store changed during the save. Nothing was published; check the key store "
            "and save again"
        )
    return EncryptionSection(
        cipher=CIPHER,
        kek_id=kek_ids.pop(),
        segment_size=segment_size,
        wrapped_keys={name: wrapped for name, (_kek, wrapped) in wrapped_keys.items()},
        wrapped_mac_key=wrapped_mac_key[1],
    )
