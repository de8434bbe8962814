"""What a format-3 generation's indexes hold besides digests, planned once a layout.

The root's tensor table and each index's ``tensors`` member (every chunk's box,
file, entry name and byte range, encoded) depend only on where the tensors lie, not
on their bytes: a writer plans them once and keeps them while the layout stays
the same (:class:`~ckptvault.saving.indexes.IndexWriter`). They are planned from a
``dcp`` section (:func:`plan_indexes`: any layout DCP made), or straight from a
one-process layout of whole tensors (:func:`whole_tensors_plan`), which builds no
``dcp`` section at all: a first save of 10,000 tensors then makes no 60,000 dicts
and lists only to read them back.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.index import chunks_by_holder, encode_tensor_chunks, files_by_holder
from ckptvault.format.layout import file_holder
from ckptvault.format.tensor_table import Runs, TensorLayout, TensorTable, build_tensor_table

# A tensor stored whole in one file: its name, dtype name, shape, the file, the entry
# name in the file's header, and its byte range there.
WholeTensor = tuple[str, str, tuple[int, ...], str, str, int, int]


@dataclass(frozen=True)
class IndexPlan:
    """What a layout's indexes hold besides digests."""

    dcp: dict[str, Any] | None  # the dcp section it was made from (None: from a layout)
    holders: tuple[int, ...]
    table: TensorTable
    tensors_members: dict[int, bytes]  # holder -> the encoded ``tensors`` member of its index


def plan_indexes(dcp: dict[str, Any], file_names: list[str]) -> IndexPlan:
    """The plan of a ``dcp`` section's chunks, in files ``file_names``."""
    holders = tuple(sorted(files_by_holder(file_names)))
    by_holder = chunks_by_holder(dcp["tensors"])
    members = {holder: encode_tensor_chunks(by_holder.get(holder, {})) for holder in holders}
    holders_by_file = {name: file_holder(name) or 0 for name in file_names}
    table = build_tensor_table(
        dcp["tensors"], lambda name: holders_by_file.get(name) or file_holder(name) or 0
    )
    return IndexPlan(dcp, holders, table, members)


def whole_tensors_plan(holder: int, tensors: Iterable[WholeTensor]) -> IndexPlan:
    """The plan of tensors each stored whole, as one chunk, in files of index
    ``holder``: what :func:`plan_indexes` makes of the ``dcp`` section of the same
    layout, with no such section built (no tensor: no index)."""
    layouts: dict[str, TensorLayout] = {}
    pieces: list[tuple[str, bytes]] = []
    single = Runs.of([(holder, 1)])
    files: dict[str, bytes] = {}  # each file's name, encoded once
    # A layout says nothing of its tensor's name: tensors of one dtype and shape share
    # one (10,000 LayerNorm weights are one object, not 10,000 for the collector).
    shared: dict[tuple[str, tuple[int, ...]], TensorLayout] = {}
    for fqn, dtype, shape, file, name, start, length in tensors:
        layout = shared.get((dtype, shape))
        if layout is None:
            layout = shared[dtype, shape] = (
                TensorLayout(dtype, shape, (), single)
                if all(shape)
                else TensorLayout(dtype, shape, holders=Runs.of([]))
            )
        layouts[fqn] = layout
        # dumps_canonical([[offsets, sizes, file, name, start, length]]), written out:
        # the strings encoded by it, the integers as JSON writes them.
        key = dumps_canonical(fqn)
        quoted = files.get(file) or files.setdefault(file, dumps_canonical(file))
        dims = ",".join(map(str, shape)).encode()
        zeros = ",".join("0" * len(shape)).encode()
        entry = key if name == fqn else dumps_canonical(name)
        row = b"[[[%b],[%b],%b,%b,%d,%d]]" % (zeros, dims, quoted, entry, start, length)
        pieces.append((fqn, key + b":" + row))
    table = TensorTable(dict(sorted(layouts.items())))
    if not pieces:  # no tensor, no file: no index
        return IndexPlan(None, (), table, {})
    pieces.sort()
    member = b"{" + b",".join(piece for _fqn, piece in pieces) + b"}"
    return IndexPlan(None, (holder,), table, {holder: member})
