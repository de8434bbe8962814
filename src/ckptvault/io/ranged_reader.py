"""A DCP ``StorageReader`` that reads only the byte ranges a rank's load plan needs.

In a multi-rank restore each rank loads its own shards. The plan DCP makes for it
names, per saved chunk, the sub-box of that chunk the rank needs
(``storage_offsets``/``lengths``). Its bytes in the chunk (row-major) lie in the
whole rows along dimension 0 that hold it (all of them for a row shard, as FSDP2
makes); this reader reads exactly those rows through
:class:`~ckptvault.io.verified_ranges.VerifiedRanges` — which rounds it out to whole
digest chunks and verifies each before a byte is used — into a private staging
buffer, and copies the sub-box into the destination DCP gives (the restore's private
buffer). A rank therefore reads about its own shards plus the replicated tensors,
not every rank's files.

What no rank reads is not verified by this restore (it is not used either);
``ckptvault verify`` checks whole generations.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ckptvault.errors import FormatError
from ckptvault.io.dcp_metadata import StoredChunk, dtype_from_name, tensor_metadata
from ckptvault.io.reader import VaultStorageReader
from ckptvault.io.verified_ranges import BlockSource, VerifiedRanges


class RangedStorageReader(VaultStorageReader):
    """:class:`VaultStorageReader` whose ``read_data`` reads only what the plan needs.

    ``source``: where digest chunks come from before the store (chunks another rank
    read and sent; :mod:`ckptvault.distributed.read_once`); every one is verified
    against its digest all the same."""

    def __init__(self, *args: Any, source: BlockSource | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.source = source

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        ranges = VerifiedRanges(self.store, self.ref, self.manifest, self.data_keys, self.source)
        # In file order: each verified block is read (and hashed) once, not per tensor.
        for item in self.ordered(plan):
            self._read_item(ranges, item, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def ordered(self, plan: LoadPlan) -> list[ReadItem]:
        """The plan's items in the order ``read_data`` reads them: by file and offset."""
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise FormatError(f"{item.storage_index.fqn!r} is a pickled object; refused")
        return sorted(plan.items, key=self._position)

    def byte_ranges(self, plan: LoadPlan) -> list[tuple[str, int, int]]:
        """(file, start, end) of the bytes each item reads, in reading order: offsets
        in the tensor file as it holds them (the plaintext of an encrypted one)."""
        ranges = []
        for item in self.ordered(plan):
            location, dtype, _sizes, first, last = self._span_of(item)
            itemsize = dtype.itemsize
            if last >= first:
                start = location.start + first * itemsize
                ranges.append((location.file, start, location.start + (last + 1) * itemsize))
        return ranges

    def _position(self, item: ReadItem) -> tuple[str, int]:
        location: StoredChunk = self.locations[item.storage_index]
        return location.file, location.start

    def _span_of(self, item: ReadItem) -> tuple[StoredChunk, torch.dtype, list[int], int, int]:
        """Where ``item``'s chunk is stored, its dtype and sizes, and the first and last
        element (row-major, in the chunk) of the whole rows that hold its sub-box."""
        location: StoredChunk = self.locations[item.storage_index]
        info = tensor_metadata(self.metadata, item.storage_index.fqn)
        dtype = dtype_from_name(
            str(info.properties.dtype).removeprefix("torch."), item.storage_index.fqn
        )
        sizes = list(_chunk_of(info.chunks, item).sizes)
        first, last = _span(sizes, list(item.storage_offsets), list(item.lengths))
        if (last + 1) * dtype.itemsize > location.length:
            raise FormatError(
                f"{item.storage_index.fqn!r}: the load plan reaches past its stored chunk"
            )
        return location, dtype, sizes, first, last

    def _read_item(self, ranges: VerifiedRanges, item: ReadItem, planner: LoadPlanner) -> None:
        location, dtype, sizes, first, last = self._span_of(item)
        itemsize = dtype.itemsize
        staging = torch.empty((last + 1 - first) * itemsize, dtype=torch.uint8)
        if staging.numel():
            ranges.read_range(
                location.file, location.start + first * itemsize, staging.numpy().data
            )
        piece = _sub_box(staging.view(dtype), sizes, item)
        destination = planner.resolve_tensor(item).detach()
        destination.copy_(piece)
        planner.commit_tensor(item, destination)
        if self.on_bytes is not None:
            self.on_bytes(staging.numel())


def _chunk_of(chunks: Sequence[ChunkStorageMetadata], item: ReadItem) -> ChunkStorageMetadata:
    """The saved chunk ``item`` reads from (by its offset, as DCP indexes chunks)."""
    offsets = list(item.storage_index.offset or ())
    for chunk in chunks:
        if list(chunk.offsets) == offsets:
            return chunk
    raise FormatError(f"{item.storage_index.fqn!r}: no saved chunk at offset {offsets}")


def _span(sizes: list[int], offsets: list[int], lengths: list[int]) -> tuple[int, int]:
    """The row-major element indices, in a chunk of ``sizes``, of the first and last
    element of the whole rows (along dimension 0) that hold a sub-box; (0, -1) when
    it is empty. A 0-d chunk is its one element."""
    if any(length == 0 for length in lengths):
        return 0, -1
    if not sizes:
        return 0, 0
    row = math.prod(sizes[1:])
    return offsets[0] * row, (offsets[0] + lengths[0]) * row - 1


def _sub_box(flat: torch.Tensor, sizes: list[int], item: ReadItem) -> torch.Tensor:
    """The sub-box out of the whole rows read (see :func:`_span`)."""
    if not sizes:
        return flat.reshape(())
    box = flat.reshape([item.lengths[0], *sizes[1:]])
    for dim, (offset, length) in enumerate(
        zip(item.storage_offsets[1:], item.lengths[1:], strict=True), start=1
    ):
        box = box.narrow(dim, offset, length)
    return box
