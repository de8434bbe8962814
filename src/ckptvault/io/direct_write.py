"""The single-process write path: a flat ``{key: tensor}`` dict straight to files.

One process saving plain tensors has nothing for DCP to plan, yet ``dcp.save``
builds a global plan, runs its collectives' single-process stand-ins and makes
several Python objects and log records per tensor: about 150 microseconds a tensor,
so a state of 10,000 small tensors spent most of its save there. This path lays
the tensors out itself and keeps that layout (files, their headers, the manifest's
``dcp`` section, already encoded) for as long as the state's layout — each key's
dtype and shape, in order — stays the same: a training loop pays for it once.

What it writes is exactly what the DCP path writes for the same tensors (the same
files, headers and ``dcp`` section: :func:`~ckptvault.io.writer.write_tensor_file`
does the writing on both), so restore, verify and resharding do not know which
path wrote a generation. Many ranks, DTensors and any tensor subclass still go
through DCP (:func:`ckptvault.io.dcp_io.write_tensors`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.index_plan import IndexPlan, whole_tensors_plan
from ckptvault.format.layout import ENCRYPTED_SUFFIX, tensor_file_name
from ckptvault.format.tensorfile import TensorFileHeader, build_header
from ckptvault.io.dcp_metadata import dtype_name
from ckptvault.io.writer import (
    MIN_FILE_BYTES,
    VaultStorageWriter,
    WrittenFile,
    tensor_bytes,
    write_tensor_file,
)
from ckptvault.storage.base import StagingArea
from ckptvault.trust.envelope import FileEncryption

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)
_FILE_METADATA = {"format": "pt", "writer": "ckptvault"}
LayoutKey = tuple[Any, ...]


@dataclass(frozen=True)
class PlannedFile:
    """One tensor file of a layout: its name and its tensors' keys, in file order."""

    name: str
    keys: tuple[str, ...]
    header: TensorFileHeader


@dataclass(frozen=True)
class DirectLayout:
    """Where every tensor of one state layout goes, and what its index holds."""

    key: LayoutKey
    files: tuple[PlannedFile, ...]
    index_plan: IndexPlan  # format 3: the root's tensor table, the index's chunk list

    @functools.cached_property
    def dcp_json(self) -> dict[str, Any]:
        """The ``dcp`` section saying so (formats 1-2 list it in the manifest)."""
        return _dcp_section(self.files)

    @functools.cached_property
    def dcp_bytes(self) -> bytes:
        """``dumps_canonical(dcp_json)``, encoded once for every save."""
        return dumps_canonical(self.dcp_json)


def layout_key(tensors: dict[str, torch.Tensor], files: int, encrypted: bool) -> LayoutKey | None:
    """What a layout depends on; None when a tensor is not a plain dense tensor (a
    DTensor, any other subclass), which only DCP knows how to lay out."""
    described: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    for key, tensor in tensors.items():
        if type(tensor) not in _PLAIN_TYPES:
            return None
        described.append((key, tensor.dtype, tuple(tensor.shape)))
    return (files, encrypted, *described)


def _file_count(sizes: dict[str, int], threads: int) -> int:
    # As the DCP path: one file per writer thread, none smaller than MIN_FILE_BYTES.
    total = sum(sizes.values())
    return max(1, min(threads, len(sizes), math.ceil(total / MIN_FILE_BYTES)))


def plan_layout(key: LayoutKey, threads: int, rank: int) -> DirectLayout:
    """Split the tensors ``key`` describes into files of similar size (largest first,
    each to the least loaded file), order each file widest dtype first then by name
    (every tensor stays aligned), and build the headers and the index plan."""
    files, encrypted, *described = key
    shapes = {name: (dtype, shape) for name, dtype, shape in described}
    sizes = {name: math.prod(shape) * dtype.itemsize for name, (dtype, shape) in shapes.items()}
    bins: list[list[str]] = [[] for _ in range(files)]
    loads = [0] * files
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        target = loads.index(min(loads))
        bins[target].append(name)
        loads[target] += sizes[name]
    planned = []
    for index, names in enumerate(b for b in bins if b):
        names.sort(key=lambda n: (-shapes[n][0].itemsize, n))
        header = build_header(
            ((n, dtype_name(shapes[n][0]), shapes[n][1]) for n in names), _FILE_METADATA
        )
        suffix = ENCRYPTED_SUFFIX if encrypted else ""
        planned.append(PlannedFile(tensor_file_name(rank, index) + suffix, tuple(names), header))
    whole = (
        (name, entry.dtype, entry.shape, file.name, name, entry.start, entry.nbytes)
        for file in planned
        for name in file.keys
        for entry in (file.header.entries[name],)
    )
    return DirectLayout(key, tuple(planned), whole_tensors_plan(rank, whole))


def _dcp_section(files: tuple[PlannedFile, ...]) -> dict[str, Any]:
    """The manifest's ``dcp`` section (:mod:`ckptvault.io.dcp_metadata`'s form): each
    tensor one chunk covering all of it, as DCP plans a plain tensor."""
    tensors: dict[str, Any] = {}
    for planned in files:
        for name in planned.keys:
            entry = planned.header.entries[name]
            chunk = {
                "offsets": [0] * len(entry.shape),
                "sizes": list(entry.shape),
                "file": planned.name,
                "name": name,
                "start": entry.start,
                "length": entry.nbytes,
            }
            tensors[name] = {"dtype": entry.dtype, "shape": list(entry.shape), "chunks": [chunk]}
    return {"version": None, "tensors": dict(sorted(tensors.items()))}


class DirectWriter:
    """One manager's single-process writer; keeps the last layout it planned."""

    def __init__(self) -> None:
        self._layout: DirectLayout | None = None

    def write(
        self,
        tensors: dict[str, torch.Tensor],
        staging: StagingArea,
        chunk_size: int,
        threads: int,
        encryption: FileEncryption | None,
        rank: int = 0,
        indexed: bool = True,
        on_bytes: Callable[[int], None] | None = None,
    ) -> VaultStorageWriter | None:
        """Write ``tensors`` into ``staging``; the result carries what the DCP path's
        writer would (file records, wrapped keys, commit times) and, for a manifest
        with indexes (``indexed``, format 3), the layout's index plan (its ``dcp_json``
        lists no chunk), else the ``dcp`` section and ``dcp_bytes``. None, having
        written nothing, when only DCP can lay them out. ``on_bytes``: told each piece
        of bytes written (from the writer threads)."""
        sizes = {key: t.numel() * t.element_size() for key, t in tensors.items()}
        key = layout_key(tensors, _file_count(sizes, threads), encryption is not None)
        if key is None:
            return None
        layout = self._layout
        reused = layout is not None and layout.key == key
        if layout is None or not reused:
            layout = self._layout = plan_layout(key, threads, rank)
        result = VaultStorageWriter(staging, chunk_size, threads, encryption, rank, on_bytes)
        result.reused_plan = reused
        if indexed:
            result.dcp_json, result.index_plan = {"version": None, "tensors": {}}, layout.index_plan
        else:
            result.dcp_json, result.dcp_bytes = layout.dcp_json, layout.dcp_bytes
        result.own_files = [planned.name for planned in layout.files]

        def write_one(planned: PlannedFile) -> WrittenFile:
            pieces = ((name, tensor_bytes(tensors[name])) for name in planned.keys)
            return write_tensor_file(
                staging, planned.name, planned.header, pieces, chunk_size, encryption, on_bytes
            )

        if len(layout.files) <= 1:  # no tensors at all: no file
            written = [write_one(planned) for planned in layout.files]
        else:
            with ThreadPoolExecutor(
                len(layout.files), thread_name_prefix="ckptvault-write"
            ) as pool:
                written = list(pool.map(write_one, layout.files))
        for planned, done in zip(layout.files, written, strict=True):
            result.file_records[planned.name] = done.record
            result.commit_seconds[planned.name] = done.commit_seconds
            if done.wrapped_key is not None:
                result.wrapped_keys[planned.name] = done.wrapped_key
        return result
