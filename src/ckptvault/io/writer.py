"""ckptvault's DCP ``StorageWriter``: tensors -> hashed, fsync'd safetensors files.

DCP's planner decides *what* each rank writes; this writer decides *how*: it packs
a rank's write items into a few safetensors-compatible files (one per worker
thread, balanced by size), streams each tensor's bytes straight from tensor memory
into the file while hashing them (whole file and fixed-size chunks), and fsyncs
every file. It never publishes anything: ``finish`` only records the DCP metadata
and the file digests for the manager, which writes the manifest and publishes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ckptvault.errors import FormatError
from ckptvault.format.index_plan import IndexPlan
from ckptvault.format.layout import ENCRYPTED_SUFFIX, tensor_file_name
from ckptvault.format.records import FileRecord
from ckptvault.format.tensorfile import TensorFileHeader, build_header
from ckptvault.io.dcp_metadata import StoredChunk, dtype_name, metadata_to_json
from ckptvault.storage.base import StagingArea, WritableFile
from ckptvault.trust.digests import FileDigester
from ckptvault.trust.envelope import EncryptingWriter, FileEncryption

WRITE_PIECE = 8 * 1024 * 1024  # bytes handed to write()/hash at a time
COALESCE_BYTES = 1024 * 1024  # tensors smaller than this are gathered into one write
MIN_FILE_BYTES = 64 * 1024 * 1024  # don't split a rank's data into files smaller than this


# Files of one generation, at most, beyond one a rank: each costs a create, an fsync
# and a directory entry on a parallel file system's metadata server (an upload on S3)
# and an entry in the root manifest every rank reads. At 512 ranks and more, a rank
# writes fewer than its threads' worth of files (4 at 1,024 ranks): the file system,
# not a rank's threads, is what limits a save at that scale.
MAX_GENERATION_FILES = 4096


def default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


def files_per_rank(threads: int, world_size: int) -> int:
    """How many tensor files each of ``world_size`` ranks writes, at most."""
    return max(1, min(threads, MAX_GENERATION_FILES // max(1, world_size)))


@dataclasses.dataclass(frozen=True)
class WrittenChunk:
    """``WriteResult.storage_data``: the chunk's location, and (on the first chunk of
    each file) that file's record, so the coordinator learns every rank's digests."""

    location: StoredChunk
    file_record: FileRecord | None = None
    wrapped_key: tuple[str, bytes] | None = None  # (KEK id, wrapped data key), encrypted files


class HashingSink:
    """Writes to a staging file and hashes exactly the bytes stored; ``on_bytes`` is
    told the size of each write once it returned (a save's progress, for a hang
    watchdog: :mod:`ckptvault.saving.save_watch`)."""

    def __init__(
        self,
        inner: WritableFile,
        digester: FileDigester,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        self.inner = inner
        self.digester = digester
        self.on_bytes = on_bytes

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.inner.write(data)
        self.digester.update(data)
        size = len(memoryview(data))
        if self.on_bytes is not None:
            self.on_bytes(size)
        return size


def chunk_name(item: WriteItem) -> str:
    if item.type == WriteItemType.TENSOR:
        return item.index.fqn
    offsets = ",".join(str(o) for o in item.index.offset or ())
    return f"{item.index.fqn}@{offsets}"


# Dtypes numpy holds: their tensors' bytes are a cast of ``tensor.numpy()`` away.
_NUMPY_DTYPES = frozenset(
    {
        torch.float16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.complex64,
        torch.complex128,
    }
)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The tensor's bytes as a flat memoryview; copies only when it must (device or
    non-contiguous layout), never for a contiguous CPU tensor."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.is_cpu and tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg()):
        if tensor.dtype in _NUMPY_DTYPES:  # the hot path: one call, no copy
            array = tensor.numpy()
            return array.data.cast("B") if array.size else memoryview(b"")
        return tensor.reshape(-1).view(torch.uint8).numpy().data  # no copy either
    if not tensor.is_cpu:
        tensor = tensor.cpu()
    tensor = tensor.resolve_conj().resolve_neg().contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _tensor_data(item: WriteItem) -> TensorWriteData:
    """A tensor write item's properties (BYTE_IO items were refused before)."""
    assert item.tensor_data is not None
    return item.tensor_data


def _bucket(items: list[WriteItem], files: int) -> list[list[WriteItem]]:
    """Largest-first greedy split of items into ``files`` bins of similar size."""
    bins: list[list[WriteItem]] = [[] for _ in range(files)]
    loads = [0] * files
    for item in sorted(items, key=lambda i: (-(i.tensor_storage_size() or 0), i.index.fqn)):
        target = loads.index(min(loads))
        bins[target].append(item)
        loads[target] += item.tensor_storage_size() or 0
    return [b for b in bins if b]


class VaultStorageWriter(StorageWriter):
    def __init__(
        self,
        staging: StagingArea,
        chunk_size: int,
        threads: int | None = None,
        encryption: FileEncryption | None = None,
        rank: int = 0,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """``on_bytes``: told each piece of bytes written (from the writer threads)."""
        super().__init__()
        self.staging = staging
        self.on_bytes = on_bytes
        self.chunk_size = chunk_size
        self.threads = threads or default_threads()
        self.encryption = encryption
        self.rank = rank
        self.is_coordinator = True
        self.dcp_json: dict[str, Any] | None = None
        self.dcp_bytes: bytes | None = None  # dumps_canonical(dcp_json), when kept encoded
        self.file_records: dict[str, FileRecord] = {}
        self.wrapped_keys: dict[str, tuple[str, bytes]] = {}
        self.own_files: list[str] = []  # written by this rank (file_records: every rank's)
        self.reused_plan = False
        # Format 3, one process: what the layout's index holds, planned with the layout
        # (ckptvault.io.direct_write); None: the index writer plans it from dcp_json.
        self.index_plan: IndexPlan | None = None
        # Seconds each file's commit (fsync; an upload's completion) took: files are
        # written in parallel, so the longest is what making them durable cost the save.
        self.commit_seconds: dict[str, float] = {}

    # -- DCP protocol ------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.dcp_json = None
        self.dcp_bytes = None
        self.file_records = {}
        self.wrapped_keys = {}
        self.own_files = []
        self.commit_seconds = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # The rank given at construction (the coordinator's) names the files; DCP's
        # own rank agrees with it under torch.distributed and is 0 without it.
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        rank = self.rank  # each rank names its files after itself: names never collide
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                raise FormatError(f"{item.index.fqn!r} is not a tensor; ckptvault never pickles")
        total = sum(item.tensor_storage_size() or 0 for item in plan.items)
        files = max(1, min(self.threads, len(plan.items), math.ceil(total / MIN_FILE_BYTES)))
        buckets = _bucket(list(plan.items), files)
        results: list[WriteResult] = []
        if len(buckets) <= 1:
            for index, bucket in enumerate(buckets):
                results += self._write_file(tensor_file_name(rank, index), bucket, planner)
        else:
            with ThreadPoolExecutor(len(buckets), thread_name_prefix="ckptvault-write") as pool:
                futures = [
                    pool.submit(self._write_file, tensor_file_name(rank, index), bucket, planner)
                    for index, bucket in enumerate(buckets)
                ]
                for future in futures:
                    results += future.result()
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        locations: dict[MetadataIndex, StoredChunk] = {}
        for rank_results in results:
            for result in rank_results:
                written: WrittenChunk = result.storage_data
                locations[result.index] = written.location
                if written.file_record is not None:
                    self.file_records[written.location.file] = written.file_record
                if written.wrapped_key is not None:
                    self.wrapped_keys[written.location.file] = written.wrapped_key
        metadata.storage_data = locations
        self.dcp_json = metadata_to_json(metadata, locations)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # never chosen automatically; the manager builds it

    def storage_meta(self) -> None:
        return None

    # -- one file ----------------------------------------------------------------------

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> list[WriteResult]:
        """Write one tensor file (a safetensors file, or an encrypted container of
        one) and fsync it; returns DCP's write results, the first carrying the
        file's record and wrapped key."""
        items, header = _layout(items)
        if self.encryption is not None:
            name += ENCRYPTED_SUFFIX
        self.own_files.append(name)
        pieces = ((chunk_name(item), _resolved_bytes(item, planner)) for item in items)
        written = write_tensor_file(
            self.staging, name, header, pieces, self.chunk_size, self.encryption, self.on_bytes
        )
        self.commit_seconds[name] = written.commit_seconds
        return _results(name, items, header, written.record, written.wrapped_key)


@dataclasses.dataclass(frozen=True)
class WrittenFile:
    """One tensor file written and made durable."""

    record: FileRecord
    wrapped_key: tuple[str, bytes] | None  # (KEK id, wrapped data key), encrypted files
    commit_seconds: float  # its fsync (an upload's completion)


def write_tensor_file(
    staging: StagingArea,
    name: str,
    header: TensorFileHeader,
    pieces: Iterable[tuple[str, memoryview]],
    chunk_size: int,
    encryption: FileEncryption | None,
    on_bytes: Callable[[int], None] | None = None,
) -> WrittenFile:
    """Write one tensor file into ``staging``: ``header``, then each ``(entry name,
    bytes)`` of ``pieces`` in the header's order (a file name ending in
    ``ENCRYPTED_SUFFIX`` with ``encryption``: a container of it under a fresh data
    key), hashed as written, then committed (fsync). A failure aborts the file.
    ``on_bytes`` is told each piece written to the store (see :class:`HashingSink`)."""
    digester = FileDigester(chunk_size)
    sink = staging.create_file(name)
    try:
        hashing = HashingSink(sink, digester, on_bytes)
        out, wrapped_key = _open_output(hashing, name, header, encryption)
        out.write(header.header_bytes)
        _write_pieces(out, header, pieces)
        if isinstance(out, EncryptingWriter):
            out.close()
    except BaseException:
        sink.abort()
        raise
    begun = time.perf_counter()
    sink.commit()
    return WrittenFile(digester.finish(), wrapped_key, time.perf_counter() - begun)


def _open_output(
    hashing: HashingSink, name: str, header: TensorFileHeader, encryption: FileEncryption | None
) -> tuple[HashingSink | EncryptingWriter, tuple[str, bytes] | None]:
    """Where the plaintext goes: straight into the hashed file, or through a fresh
    per-file data key into an encrypted container."""
    if encryption is None:
        return hashing, None
    data_key, kek_id, wrapped = encryption.new_file_key(name)
    plaintext_size = header.data_start + sum(e.nbytes for e in header.entries.values())
    encrypting = EncryptingWriter(
        hashing,
        data_key,
        encryption.context(name),
        encryption.segment_size,
        plaintext_size,
        where=name,
    )
    return encrypting, (kek_id, wrapped)


def _write_pieces(
    out: HashingSink | EncryptingWriter,
    header: TensorFileHeader,
    pieces: Iterable[tuple[str, memoryview]],
) -> None:
    """Each tensor's bytes in the header's order. Small tensors are gathered into one
    buffer and written together (10,000 tensors of 1 KB are 10 writes, not 10,000);
    large ones go straight from tensor memory, in pieces. The buffer is made only
    for a file that holds a small tensor."""
    buffer = bytearray()  # made full size for the first small tensor
    filled = 0
    position = header.data_start
    for name, data in pieces:
        entry = header.entries[name]
        if len(data) != entry.nbytes:
            raise FormatError(
                f"tensor {name!r} changed size while being saved "
                f"({len(data)} bytes, planned {entry.nbytes})"
            )
        if entry.start != position:  # a bug here, never the user's: refuse to save
            raise FormatError(f"tensor {name!r} came out of its file's order; nothing saved")
        position = entry.end
        if len(data) >= COALESCE_BYTES:
            if filled:
                out.write(memoryview(buffer)[:filled])
                filled = 0
            for start in range(0, len(data), WRITE_PIECE):
                out.write(data[start : start + WRITE_PIECE])
            continue
        if not buffer:
            buffer = bytearray(COALESCE_BYTES)
        if len(data) > COALESCE_BYTES - filled:
            out.write(memoryview(buffer)[:filled])
            filled = 0
        buffer[filled : filled + len(data)] = data
        filled += len(data)
    if filled:
        out.write(memoryview(buffer)[:filled])


def _layout(items: list[WriteItem]) -> tuple[list[WriteItem], TensorFileHeader]:
    """Order a file's tensors and build its safetensors header."""
    # Wider elements first keeps every tensor naturally aligned, as safetensors does.
    items = sorted(items, key=lambda i: (-_tensor_data(i).properties.dtype.itemsize, chunk_name(i)))
    header = build_header(
        (
            (
                chunk_name(i),
                dtype_name(_tensor_data(i).properties.dtype),
                tuple(_tensor_data(i).chunk.sizes),
            )
            for i in items
        ),
        {"format": "pt", "writer": "ckptvault"},
    )
    return items, header


def _resolved_bytes(item: WriteItem, planner: SavePlanner) -> memoryview:
    """The bytes of the tensor DCP's planner resolves ``item`` to."""
    resolved = planner.resolve_data(item)
    if not isinstance(resolved, torch.Tensor):
        raise FormatError(f"{item.index.fqn!r} is not a tensor; ckptvault never pickles")
    return tensor_bytes(resolved)


def _results(
    name: str,
    items: list[WriteItem],
    header: TensorFileHeader,
    record: FileRecord,
    wrapped_key: tuple[str, bytes] | None,
) -> list[WriteResult]:
    results = []
    for position, item in enumerate(items):
        entry = header.entries[chunk_name(item)]
        location = StoredChunk(file=name, name=entry.name, start=entry.start, length=entry.nbytes)
        first = position == 0
        results.append(
            WriteResult(
                index=item.index,
                size_in_bytes=entry.nbytes,
                storage_data=WrittenChunk(
                    location, record if first else None, wrapped_key if first else None
                ),
            )
        )
    return results
