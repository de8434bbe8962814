"""ckptvault's DCP ``StorageReader``: verify every byte while reading it.

The reader streams every file of the generation once, in chunk-sized blocks, on
worker threads. Each block is checked against its chunk digest before any of its
bytes is copied anywhere; the whole-file digest and size are checked at the end.
Bytes are copied only into destination tensors the restore allocated privately
(never the caller's objects), so a generation that fails half-way through leaves
nothing behind; the manager applies the loaded values only after every file
verified.

Every file is read even if the load plan needs only part of it: a restore verifies
the whole candidate, not just what it happens to use.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ckptvault.errors import FormatError, IntegrityError
from ckptvault.format.layout import is_tensor_file_name
from ckptvault.format.manifest import Manifest
from ckptvault.format.tensorfile import header_length, header_size_limit, parse_header
from ckptvault.io.dcp_metadata import StoredChunk, dtype_from_name, tensor_metadata
from ckptvault.io.direct_read import descriptor, read_plain_direct
from ckptvault.io.read_targets import FilePlan, Scatter, Target
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.chunk_layout import check_chunk_locations
from ckptvault.trust.digests import ChunkVerifier, read_full
from ckptvault.trust.envelope import SegmentDecryptor, binding


class VaultStorageReader(StorageReader):
    def __init__(
        self,
        store: Store,
        ref: GenerationRef,
        manifest: Manifest,
        metadata: Metadata,
        locations: dict[MetadataIndex, StoredChunk],
        threads: int,
        on_bytes: Callable[[int], None] | None = None,
        data_keys: dict[str, bytes] | None = None,
        needed_files_only: bool = False,
        zero_copy: bool = True,
    ) -> None:
        super().__init__()
        # True: read (and so verify) only the files holding chunks this rank's plan
        # loads (the DCP plugin, where each of many ranks loads its own shards).
        self.needed_files_only = needed_files_only
        # False: never ``preadv`` into destinations, which hashes bytes where they
        # land; for destinations that are the caller's own tensors (the DCP plugin),
        # every chunk is verified in a bounce buffer before it is copied there.
        self.zero_copy = zero_copy
        self.data_keys = data_keys or {}
        self.store = store
        self.ref = ref
        self.manifest = manifest
        self.metadata = metadata
        self.locations = locations
        self.threads = max(1, threads)
        self.on_bytes = on_bytes

    # -- DCP protocol ------------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # Every tensor file is read (and so verified) even when nothing is loaded from it.
        file_plans = {name: FilePlan() for name in self.manifest.files if is_tensor_file_name(name)}
        by_chunk: dict[StoredChunk, list[ReadItem]] = defaultdict(list)
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise FormatError(f"{item.storage_index.fqn!r} is a pickled object; refused")
            by_chunk[self.locations[item.storage_index]].append(item)
        for location, items in by_chunk.items():
            if location.file not in file_plans:
                raise FormatError(
                    f"chunk of {items[0].storage_index.fqn!r} lives in unknown file {location.file}"
                )
            file_plans[location.file].targets.append(self._target(location, items, planner))
        if self.needed_files_only:
            file_plans = {name: fp for name, fp in file_plans.items() if fp.targets}
        self.read_files(file_plans)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def read_files(self, file_plans: dict[str, FilePlan]) -> None:
        """Read each named file whole, verifying every chunk before its bytes land in
        the file's targets; files in parallel on the reader's threads."""
        names = sorted(file_plans)
        if self.threads == 1 or len(names) <= 1:
            for name in names:
                self._read_file(name, file_plans[name])
        else:
            with ThreadPoolExecutor(
                min(self.threads, len(names)), thread_name_prefix="ckptvault-read"
            ) as pool:
                for future in [pool.submit(self._read_file, n, file_plans[n]) for n in names]:
                    future.result()

    # -- helpers -----------------------------------------------------------------------

    def _target(self, location: StoredChunk, items: list[ReadItem], planner: LoadPlanner) -> Target:
        fqn = items[0].storage_index.fqn
        info = tensor_metadata(self.metadata, fqn)
        chunk_meta = info.chunks[_chunk_index(info.chunks, items[0].storage_index)]
        dtype = dtype_from_name(str(info.properties.dtype).removeprefix("torch."), fqn)
        sizes = list(chunk_meta.sizes)
        end = location.start + location.length
        if len(items) == 1:
            item = items[0]
            destination = planner.resolve_tensor(item).detach()
            whole = list(item.lengths) == sizes and all(o == 0 for o in item.storage_offsets)
            if (
                whole
                and destination.device.type == "cpu"
                and destination.dtype == dtype
                and destination.is_contiguous()
                and destination.numel() * destination.element_size() == location.length
            ):
                # Fast path: verified bytes land directly in the destination tensor.
                flat = destination.reshape(-1).view(torch.uint8)
                return Target(
                    direct=True,
                    start=location.start,
                    end=end,
                    buffer=flat,
                    finish=lambda: planner.commit_tensor(item, destination),
                )

        staging = torch.empty(location.length, dtype=torch.uint8)

        def scatter() -> None:
            source = staging.view(dtype).reshape(sizes)
            for item in items:
                piece = source
                for dim, (offset, length) in enumerate(
                    zip(item.storage_offsets, item.lengths, strict=True)
                ):
                    piece = piece.narrow(dim, offset, length)
                destination = planner.resolve_tensor(item).detach()
                destination.copy_(piece)
                planner.commit_tensor(item, destination)

        return Target(location.start, end, staging, scatter)

    def _read_file(self, name: str, file_plan: FilePlan) -> None:
        """Stream one file: verify each chunk, (decrypt,) scatter into targets.

        Only chunk digests are checked here: together with the size they cover every
        byte. (The whole-file digest is for ``ckptvault verify`` and external tools.)
        """
        record = self.manifest.files[name]
        verifier = ChunkVerifier(record, self.manifest.chunk_size, name, whole_file=False)
        if name not in self.data_keys and self.zero_copy and hasattr(os, "preadv"):
            with self.store.open_file(self.ref, name) as stream:
                fd = descriptor(stream)
                if fd is not None:
                    read_plain_direct(
                        fd,
                        name,
                        record.size,
                        self.manifest.chunk_size,
                        file_plan,
                        verifier,
                        self.on_bytes,
                    )
                    return
        self._read_streamed(name, file_plan, verifier)

    def _read_streamed(self, name: str, file_plan: FilePlan, verifier: ChunkVerifier) -> None:
        """Read the file in chunk-sized blocks through a bounce buffer, decrypting
        when it is encrypted; each block is verified before it is used."""
        record = self.manifest.files[name]
        where = name  # the generation is named by whoever reports the failure
        chunk_size = self.manifest.chunk_size
        scatter = Scatter(file_plan.targets)
        decryptor = None
        if name in self.data_keys:
            header_check = _PlainHeaderCheck(name, self.manifest)

            def emit(offset: int, plain: memoryview) -> None:
                assert decryptor is not None and decryptor.header is not None
                header_check.feed(offset, plain, decryptor.header.plaintext_size)
                scatter.put(offset, torch.frombuffer(plain, dtype=torch.uint8))

            context = binding(self.manifest.run_id, self.manifest.generation_id, name)
            decryptor = SegmentDecryptor(self.data_keys[name], context, where, emit)
        block = torch.empty(chunk_size, dtype=torch.uint8)
        block_view = block.numpy().data
        position = 0
        with self.store.open_file(self.ref, name) as stream:
            while position < record.size:
                wanted = min(chunk_size, record.size - position)
                count = read_full(stream, block_view[:wanted])
                if count != wanted:  # short: refused before any of its bytes is used
                    raise IntegrityError(
                        f"{where}: file ends at byte {position + count}, the manifest records "
                        f"{record.size}"
                    )
                verifier.update(block_view[:count])  # raises before any byte is used
                if decryptor is None:
                    scatter.put(position, block[:count])
                else:
                    decryptor.feed(block_view[:count])
                position += count
                if self.on_bytes is not None:
                    self.on_bytes(count)
            if stream.read(1):
                raise IntegrityError(
                    f"{where}: file is longer than the {record.size} bytes recorded"
                )
        verifier.finish()
        if decryptor is not None:
            decryptor.finish()
            if not header_check.done:
                raise FormatError(
                    f"{where}: the decrypted file is too short to hold a tensor header"
                )
        for target in file_plan.targets:
            target.finish()


class _PlainHeaderCheck:
    """Validates a decrypted tensor file's safetensors header against the manifest."""

    def __init__(self, name: str, manifest: Manifest) -> None:
        self.name = name
        self.manifest = manifest
        self._prefix = bytearray()
        self._total: int | None = None
        self.done = False
        # As for plain files: no larger than the entries placed in this file need.
        self._limit = header_size_limit(
            chunk["name"] for _fqn, chunk in manifest.chunks_by_file.get(name, ())
        )

    def feed(self, offset: int, plain: memoryview, plaintext_size: int) -> None:
        if self.done or offset != len(self._prefix):
            return
        self._prefix += plain
        if self._total is None and len(self._prefix) >= 8:
            self._total = header_length(
                bytes(self._prefix[:8]), plaintext_size, self.name, self._limit
            )
        if self._total is not None and len(self._prefix) >= self._total:
            self._check(bytes(self._prefix[: self._total]), plaintext_size)

    def _check(self, header_bytes: bytes, plaintext_size: int) -> None:
        self.done = True
        header = parse_header(header_bytes, plaintext_size, self.name, self._limit)
        problems = check_chunk_locations(self.manifest, {self.name: header})
        if problems:
            raise FormatError("; ".join(str(p) for p in problems))


def _chunk_index(chunks: list[Any], index: MetadataIndex) -> int:
    if (
        index.index is not None
        and index.index < len(chunks)
        and chunks[index.index].offsets == index.offset
    ):
        return index.index
    for position, chunk in enumerate(chunks):
        if chunk.offsets == index.offset:
            return position
    raise FormatError(f"no stored chunk of {index.fqn!r} at offset {list(index.offset or ())}")
