"""Drive torch.distributed.checkpoint with ckptvault's storage plugin.

``write_tensors`` saves a flat ``{key: tensor}`` dict into a staging area;
``read_tensors`` loads a verified generation's tensors into fresh buffers. Both run
DCP in a single process (``no_dist``): DCP's collectives between ranks are pickled,
so the multi-rank paths drive the same planners and storage plugin over ckptvault's
own JSON collectives (:mod:`ckptvault.distributed.dcp_save`,
:mod:`ckptvault.distributed.dcp_load`). DCP wraps
errors raised inside the plugin in ``CheckpointException``; they are unwrapped so
callers see ckptvault's typed errors.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from ckptvault.errors import CheckpointError, FormatError, SaveFailedError
from ckptvault.format.manifest import Manifest
from ckptvault.io.dcp_metadata import metadata_from_json, tensor_metadata
from ckptvault.io.direct_write import DirectWriter
from ckptvault.io.planners import TensorOnlyLoadPlanner, TensorOnlySavePlanner
from ckptvault.io.reader import VaultStorageReader
from ckptvault.io.whole_read import cannot_allocate, plan_whole_tensors, whole_tensor_layout
from ckptvault.io.writer import VaultStorageWriter, default_threads
from ckptvault.storage.base import GenerationRef, StagingArea, Store
from ckptvault.trust.envelope import FileEncryption

# DCP warns on every single-process call; that is exactly how it is used here.
warnings.filterwarnings(
    "ignore", message=r"torch\.distributed is disabled, unavailable or uninitialized"
)


def _quiet_unheard_dcp_logger() -> None:
    """DCP logs the start and end of every planning call per tensor at DEBUG on a
    logger of its own that only has a ``NullHandler``: at 10,000 tensors that is
    20,000 log records built for nobody. When nobody listens there (every handler
    a ``NullHandler``), raise its level so the records are not built; a handler a
    user added for DCP's telemetry leaves it untouched."""
    for logger in (logging.getLogger(name) for name in list(logging.root.manager.loggerDict)):
        if (
            logger.name.startswith("c10d-")
            and logger.level == logging.DEBUG
            and logger.handlers
            and all(type(h) is logging.NullHandler for h in logger.handlers)
        ):
            logger.setLevel(logging.WARNING)


_quiet_unheard_dcp_logger()


def _reraise(exc: CheckpointException, wrap: type[CheckpointError], what: str) -> NoReturn:
    """Re-raise the original error; wrap anything untyped in ``wrap``."""
    for _rank, (original, _trace) in sorted(exc.failures.items()):
        if isinstance(original, (CheckpointError, OSError, KeyboardInterrupt, MemoryError)):
            raise original
        raise wrap(f"{what}: {type(original).__name__}: {original}") from original
    raise wrap(f"{what}: {exc}")


def write_tensors(
    tensors: dict[str, torch.Tensor],
    staging: StagingArea,
    chunk_size: int,
    threads: int | None,
    encryption: FileEncryption | None = None,
    plan_cache_key: str | None = None,
    rank: int = 0,
    direct: DirectWriter | None = None,
    indexed: bool = True,
    on_bytes: Callable[[int], None] | None = None,
) -> VaultStorageWriter:
    """Write tensors as safetensors files (or encrypted containers of them), named
    after ``rank``; the returned writer holds the DCP metadata JSON, file records and
    wrapped keys.

    One process: DCP runs without torch.distributed (``no_dist``), so none of its
    pickled collectives. Many ranks write through
    :func:`ckptvault.distributed.dcp_save.write_tensors_together` instead. ``direct``
    (the caller's :class:`DirectWriter`, which keeps its layout between saves) writes
    plain tensors without DCP's planner; same files, same metadata (``indexed``, for
    a manifest of format 3: the index plan in place of the ``dcp`` section).
    ``on_bytes`` is told each piece of bytes written (from the writer threads)."""
    if direct is not None:
        threads = threads or default_threads()
        written = direct.write(
            tensors, staging, chunk_size, threads, encryption, rank, indexed, on_bytes
        )
        if written is not None:
            return written
    writer = VaultStorageWriter(
        staging, chunk_size, threads, encryption=encryption, rank=rank, on_bytes=on_bytes
    )
    if tensors:
        try:
            planner = TensorOnlySavePlanner(plan_cache_key)
            dcp.save(tensors, storage_writer=writer, planner=planner, no_dist=True)
            writer.reused_plan = planner.reused_plan
        except CheckpointException as exc:
            _reraise(exc, SaveFailedError, "saving tensors")
    if writer.dcp_json is None:
        writer.dcp_json = {"version": None, "tensors": {}}
    return writer


def require_whole(manifest: Manifest, where: str) -> None:
    """Readers of whole tensors take every chunk as given: a format-3 manifest with
    indexes still unloaded holds only some chunks of its tensors (a rank of many's
    view), and must never be read as if it held them all."""
    if manifest.pending_indexes:
        missing = sorted(manifest.pending_indexes)
        raise FormatError(
            f"{where}: read as a whole, but {len(missing)} of its indexes are not loaded "
            f"({missing[0]}, ...); load them first (ckptvault.trust.checks.extend_checked)"
        )


def allocate_destinations(
    manifest: Manifest, where: str
) -> tuple[dict[str, torch.Tensor], Any, Any]:
    """Private buffers for every tensor of a structurally checked generation.

    The restore checks already tied every chunk to bytes the generation's files
    hold; the total is checked again here, where the memory is taken, so that a
    manifest can never make a reader allocate more than the files on disk.
    """
    require_whole(manifest, where)
    metadata, locations = metadata_from_json(manifest.dcp, where)
    infos = {fqn: tensor_metadata(metadata, fqn) for fqn in metadata.state_dict_metadata}
    needed = sum(math.prod(info.size) * info.properties.dtype.itemsize for info in infos.values())
    if needed > manifest.total_bytes:
        raise FormatError(
            f"{where}: the manifest's tensors take {needed} bytes, more than the "
            f"{manifest.total_bytes} its files hold"
        )
    try:
        destinations = {
            fqn: torch.empty(tuple(info.size), dtype=info.properties.dtype)
            for fqn, info in infos.items()
        }
    except (RuntimeError, MemoryError) as exc:  # the allocator's own error, untyped
        raise cannot_allocate(where, needed, exc) from exc
    return destinations, metadata, locations


def read_tensors(
    store: Store,
    ref: GenerationRef,
    manifest: Manifest,
    threads: int,
    on_bytes: Callable[[int], None] | None = None,
    data_keys: dict[str, bytes] | None = None,
) -> dict[str, torch.Tensor]:
    """Load every tensor of a structurally checked generation, verifying every byte.

    Returns fresh CPU tensors owned by the caller; raises IntegrityError when a
    digest or size does not match. When every tensor is stored as one whole chunk,
    its bytes are read straight into its tensor without DCP's planner
    (:mod:`ckptvault.io.whole_read`); any other layout goes through ``dcp.load``.
    """
    where = f"generation {ref.generation_id}"
    layout = whole_tensor_layout(manifest, where)
    if layout is not None:  # every tensor stored whole: nothing for DCP to plan
        destinations, file_plans = plan_whole_tensors(manifest, layout, where)
        reader = VaultStorageReader(
            store, ref, manifest, Metadata(state_dict_metadata={}), {}, threads, on_bytes, data_keys
        )
        reader.read_files(file_plans)  # every file, every chunk verified
        return destinations
    destinations, metadata, locations = allocate_destinations(manifest, where)
    reader = VaultStorageReader(
        store, ref, manifest, metadata, locations, threads, on_bytes, data_keys
    )
    if destinations:
        try:
            dcp.load(
                destinations, storage_reader=reader, planner=TensorOnlyLoadPlanner(), no_dist=True
            )
        except CheckpointException as exc:
            _reraise(exc, FormatError, f"reading {ref.location}")
    else:
        reader.read_data(_empty_plan(), TensorOnlyLoadPlanner())  # still verify every file
    return destinations


def _empty_plan() -> Any:
    from torch.distributed.checkpoint.planner import LoadPlan

    return LoadPlan(items=[])
