"""``ckptvault.dcp.StorageReader``: plain ``dcp.load`` from a ckptvault store,
every byte verified.

Constructing the reader chooses the generation (:mod:`ckptvault.dcp.choose`):
newest first, or of one ``step``, checked on every rank before any tensor byte is
read (structure, file set, sizes, headers, signature with ``trusted_keys``, run id,
encryption with ``keystore``); candidates that fail are skipped, as restore does.
Then DCP plans the load (resharding onto any number of ranks and any DTensor
layout) and :class:`~ckptvault.io.reader.VaultStorageReader` reads each rank's
chunks, checking every chunk's BLAKE3 digest before any of its bytes is copied.

The state dict's non-tensor values (an optimizer's ``param_groups``, counters) were
stored as JSON in the generation's verified state tree; they are decoded while the
generation is chosen and set in place once this rank's tensors are read
(:mod:`ckptvault.dcp.objects`), never unpickled.

DCP loads in place: a digest mismatch raises (``IntegrityError``, out of plain
``dcp.load``: :mod:`ckptvault.dcp._typed`) after the tensors read before it were
filled, so a state dict whose load raised must not be used. Only verified bytes are
ever copied into it.

With ``ledger=`` the reader holds its choice to the run's rollback floor and
published table, as ``CheckpointManager.restore`` does (:mod:`ckptvault.dcp.records`):
a published generation gone from the store is a candidate that fails (counted by
``max_fallback``), a step asked for below a newer generation that verifies is a
``RollbackError`` unless ``allow_rollback_to`` names it, and once the coordinator has
read and verified its share the floor rises to the generation read.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader as DCPStorageReader
from torch.futures import Future

from ckptvault.config import validate_step
from ckptvault.coordinator import Coordinator
from ckptvault.dcp._common import (
    KeystoreLike,
    StoreURL,
    check_run_id,
    job_coordinator,
    open_plugin_store,
    plugin_trust,
    portable,
)
from ckptvault.dcp._typed import install
from ckptvault.dcp.choose import Chooser, Chosen
from ckptvault.dcp.objects import object_setter
from ckptvault.dcp.records import PluginRecords
from ckptvault.distributed.coordinator import DEFAULT_TIMEOUT_S
from ckptvault.errors import CheckpointError, UsageError
from ckptvault.io.reader import VaultStorageReader
from ckptvault.io.writer import default_threads
from ckptvault.restoring.selector import SkippedGeneration
from ckptvault.trust.signing import PublicKeyLike


class StorageReader(DCPStorageReader):
    """A DCP ``StorageReader`` over a ckptvault store (path, ``file://``, ``s3://``, ``az://``).

    Contract: construct it on every rank of the job at the same time (choosing is
    collective; under torch.distributed it runs on a gloo group of ckptvault's own
    over the default process group, waiting at most ``collective_timeout_s`` for a
    peer). The constructor raises ``NoValidCheckpoint`` when no generation of run
    ``run_id`` (of ``step``, when given) passes every check on every rank, and the
    same error on every rank. ``dcp.load`` then copies into the state dict only bytes
    whose chunk digest matched, and raises ``IntegrityError`` (every rank) at the
    first mismatch; the non-tensor values come from the verified manifest (or
    encrypted state file), as JSON.
    Generations saved by ``ckptvault.dcp.StorageWriter`` or by
    ``CheckpointManager`` (their tensors) can be read. :attr:`step`,
    :attr:`generation_id` and :attr:`skipped` say what was chosen and why newer
    generations were passed over.

    ``ledger`` (a path outside the store; ``audit_log`` defaults beside it): the
    manager's rollback floor and published table apply (see the module docstring),
    and the load is recorded there; ``allow_rollback_to=STEP`` loads STEP on purpose,
    lowering the floor and abandoning newer generations (:attr:`rolled_back_from`).
    Without ``ledger``: no floor, and a step asked for is loaded whatever is newer.
    """

    def __init__(
        self,
        url: StoreURL,
        *,
        run_id: str,
        step: int | None = None,
        trusted_keys: Iterable[PublicKeyLike] | PublicKeyLike | None = None,
        keystore: KeystoreLike | None = None,
        s3_endpoint_url: str | None = None,
        threads: int | None = None,
        max_fallback: int | None = None,
        collective_timeout_s: float = DEFAULT_TIMEOUT_S,
        ledger: StoreURL | None = None,
        audit_log: StoreURL | None = None,
        allow_rollback_to: int | None = None,
    ) -> None:
        super().__init__()
        install(StorageReader)  # plain dcp.load raises ckptvault's errors, not DCP's wrapper
        run_id = check_run_id(run_id)
        if step is not None:
            step = validate_step(step)
        if allow_rollback_to is not None:
            allow_rollback_to = validate_step(allow_rollback_to, "allow_rollback_to")
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise UsageError(f"threads must be a positive int, got {threads!r}")
        if max_fallback is not None and (not isinstance(max_fallback, int) or max_fallback < 0):
            raise UsageError(f"max_fallback must be an int >= 0 or None, got {max_fallback!r}")
        self.store = open_plugin_store(url, s3_endpoint_url, must_exist=True)
        trust = plugin_trust(
            self.store,
            trusted_keys=trusted_keys,
            keystore=keystore,
            ledger=ledger,
            audit_log=audit_log,
        )
        coordinator: Coordinator = job_coordinator(collective_timeout_s)
        self._records = PluginRecords(trust, self.store, run_id)
        self._recorded = not coordinator.is_coordinator  # the job's records: rank 0's
        try:
            chosen = Chooser(self.store, run_id, trust, coordinator).choose(
                step, max_fallback, allow_rollback_to
            )
        except CheckpointError as exc:
            if coordinator.is_coordinator:
                self._records.refused(exc)
            raise
        self._chosen: Chosen = chosen
        manifest = chosen.prepared.checked.manifest
        self.run_id = run_id
        self.step: int = chosen.ref.step
        self.generation_id: str = chosen.ref.generation_id
        self.location: str = chosen.ref.location
        self.signer: str | None = chosen.prepared.checked.signer
        self.skipped: list[SkippedGeneration] = chosen.skipped
        rollback = chosen.rollback
        # allow_rollback_to with a ledger (the coordinator): the step gone back from.
        self.rolled_back_from: int | None = rollback.from_step if rollback else None
        self._metadata = chosen.metadata
        self._reader = VaultStorageReader(
            self.store,
            chosen.ref,
            manifest,
            chosen.metadata,
            chosen.locations,
            threads or default_threads(),
            data_keys=chosen.prepared.data_keys,
            needed_files_only=True,
            zero_copy=False,  # the destinations are the caller's: verify, then copy
        )

    def __getstate__(self) -> Any:
        raise UsageError("ckptvault.dcp.StorageReader holds open stores and keys; it is not copied")

    # -- DCP protocol ----------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """DCP calls this when ``checkpoint_id`` is given; the generation was chosen
        at construction, so there is nothing to do."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The chosen generation's DCP metadata, from its verified manifest (JSON,
        never unpickled): its tensors, and its non-tensor values as byte entries."""
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read this rank's chunks, verifying each chunk's digest before its bytes
        are copied into the state dict; then set its non-tensor values."""
        try:
            objects = [item for item in plan.items if item.type == LoadItemType.BYTE_IO]
            set_objects = object_setter(objects, planner, self._chosen.objects)
            if objects:
                tensors = [item for item in plan.items if item.type != LoadItemType.BYTE_IO]
                plan = dataclasses.replace(plan, items=tensors)
            done = self._reader.read_data(plan, planner)
            set_objects()
            self._record_restore()
            return done
        except BaseException as exc:
            raise portable(exc) from exc

    def _record_restore(self) -> None:
        """Once, on the coordinator, after its share was read and verified: the floor
        rises to the generation (or the allowed rollback lowers it), and the load is
        audited. Should another rank's share then fail its digests, the floor stays
        raised: the next load refuses to fall back below this generation silently
        (``RollbackError``; ``allow_rollback_to`` goes back on purpose)."""
        if self._recorded:
            return
        self._recorded = True
        chosen = self._chosen
        self._records.restored(chosen.ref, chosen.skipped, chosen.rollback)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen from a checkpoint_id: construct it with the store URL
