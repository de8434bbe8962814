"""Loading a format-3 generation's indexes: each one checked against the root before
a byte of it is parsed, and against the root's tensor table after.

The root manifest (its signature already checked, when one is required) lists every
index with its size and BLAKE3 digest. An index is read up to exactly that size and
hashed; only bytes that match are parsed (:func:`ckptvault.format.index.parse_index`),
and then:

- its chunk digests must derive each covered file's digest in the root, so the root
  vouches for every chunk digest;
- its non-empty chunks must be exactly the cells the root's tensor table assigns to
  it (:mod:`ckptvault.format.tensor_table`), each once. The table's grid tiles each
  shape by construction (its parts add up to every extent) and a listed layout is
  checked to tile here, so the chunks of all indexes together tile every tensor, and
  the chunks of the indexes a rank loads cover exactly the cells they hold.

A reader that needs only part of a generation (one rank of many) loads only the
indexes holding the cells it needs (:func:`indexes_for_regions`).

Unsigned, the root is the attacker's too, and a few bytes of it can name 2**24 cells
(:data:`~ckptvault.format.tensor_table.MAX_CELLS`) over thousands of indexes. So no
check here walks the table's cells or repeats per index what is the same for all:
an index costs a bisection per chunk it lists, the root's files are grouped by index
once, and the listed layouts' tiling shares one corner budget.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from blake3 import blake3

from ckptvault.errors import FormatError, IntegrityError
from ckptvault.format.index import parse_index
from ckptvault.format.layout import file_holder, index_file_name
from ckptvault.format.manifest import Manifest
from ckptvault.format.records import FileRecord
from ckptvault.format.tensor_table import Box, TensorTable
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.chunk_layout import (
    CORNER_BUDGET_BASE,
    CORNER_BUDGET_PER_CHUNK,
    tiling_problem,
)
from ckptvault.trust.digests import derived_file_digest


class IndexMismatch(FormatError):
    """An index that parses but disagrees with the root's tensor table."""


def load_indexes(
    store: Store, ref: GenerationRef, manifest: Manifest, wanted: Collection[str] | None = None
) -> Manifest:
    """``manifest`` with the indexes ``wanted`` (default: every one still pending)
    loaded: their files' chunk digests in ``files``, their chunks in ``dcp``.

    Raises :class:`IntegrityError` for an index whose bytes do not match the root,
    :class:`FormatError` for one that is malformed or disagrees with it (its file is
    named in the message), and ``OSError``/``UnsafeEntryError`` from the store.
    Formats 1-2 have no indexes: the manifest is returned as it is."""
    if not manifest.indexed:
        return manifest
    assert manifest.indexes is not None and manifest.tensor_table is not None
    pending = manifest.pending_indexes
    names = sorted(pending if wanted is None else pending & set(wanted))
    unknown = sorted(set(wanted or ()) - set(manifest.indexes))
    if unknown:
        raise FormatError(f"generation {ref.generation_id} lists no index {unknown[0]!r}")
    first_load = pending == frozenset(manifest.indexes)
    if first_load:
        _check_listed_tilings(manifest)
    files = dict(manifest.files)
    tensors = _dcp_tensors(manifest, fresh=first_load)
    table = manifest.tensor_table
    # Once per call, not once per index: a root may list many thousands of each.
    covering = _files_by_holder(manifest.files) if names else {}
    shapes = {fqn: layout.shape for fqn, layout in table.tensors.items()} if names else {}
    where = f"generation {ref.generation_id}"
    for name in names:
        holder = file_holder(name)
        assert holder is not None
        covered = covering.get(holder, {})
        data = _read_index(store, ref, name, manifest)
        contents = parse_index(
            data, holder, manifest.run_id, manifest.generation_id, covered, shapes, where
        )
        for file, digests in contents.file_chunks.items():
            files[file] = _checked_record(name, file, covered[file], digests, manifest.chunk_size)
        _check_cells(name, holder, contents.chunks, table)
        for fqn, chunks in contents.chunks.items():
            tensors[fqn]["chunks"].extend(chunks)
    dcp = {"version": manifest.dcp.get("version"), "tensors": tensors}
    return dataclasses.replace(
        manifest, files=files, dcp=dcp, pending_indexes=pending - frozenset(names)
    )


def indexes_for_files(manifest: Manifest, names: Iterable[str]) -> set[str]:
    """The indexes covering these files (none for formats 1-2)."""
    if not manifest.indexed:
        return set()
    return {index_file_name(h) for h in (file_holder(n) for n in names) if h is not None}


def indexes_for_regions(
    manifest: Manifest, regions: Mapping[str, Sequence[Box] | None]
) -> set[str]:
    """The indexes holding any cell that overlaps these regions: fqn -> the boxes a
    reader needs of it (None: all of it). Tensors the root does not list need none
    (the reader reports them missing)."""
    if not manifest.indexed:
        return set()
    assert manifest.tensor_table is not None
    table = manifest.tensor_table.tensors
    holders: set[int] = set()
    for fqn, boxes in regions.items():
        layout = table.get(fqn)
        if layout is None:
            continue
        if boxes is None:
            holders.update(layout.all_holders())
        else:
            for offsets, sizes in boxes:
                holders.update(layout.holders_of(offsets, sizes))
    return {index_file_name(h) for h in holders}


def _read_index(store: Store, ref: GenerationRef, name: str, manifest: Manifest) -> bytes:
    """The index's bytes, exactly as many as the root records, matching its digest."""
    assert manifest.indexes is not None
    record = manifest.indexes[name]
    data = store.read_bytes(ref, name, record.size)
    if len(data) != record.size or blake3(data).hexdigest() != record.blake3:
        raise IntegrityError(
            f"{name} does not match the root manifest's digest of it ({len(data)} bytes, "
            f"{record.size} recorded): it was changed or replaced after it was written"
        )
    return data


def _checked_record(
    index: str, file: str, record: FileRecord, digests: tuple[str, ...], chunk_size: int
) -> FileRecord:
    """The root's record of ``file`` with its index's chunk digests, which must derive
    the root's file digest (and be as many as its size needs)."""
    expected = -(-record.size // chunk_size)
    if len(digests) != expected or derived_file_digest(record.size, digests) != record.blake3:
        raise IntegrityError(
            f"{index}: the chunk digests of {file} do not derive the root manifest's digest "
            "of that file: the index does not belong to this root"
        )
    return dataclasses.replace(record, chunks=digests)


def _dcp_tensors(manifest: Manifest, fresh: bool) -> dict[str, dict[str, Any]]:
    """The ``dcp`` tensors to extend: every tensor of the table with no chunks yet on
    the first load, else a copy of what earlier loads gave."""
    assert manifest.tensor_table is not None
    if fresh:
        return {
            fqn: {"dtype": layout.dtype, "shape": list(layout.shape), "chunks": []}
            for fqn, layout in manifest.tensor_table.tensors.items()
        }
    return {
        fqn: {**info, "chunks": list(info["chunks"])}
        for fqn, info in manifest.dcp["tensors"].items()
    }


def _files_by_holder(files: Mapping[str, FileRecord]) -> dict[int, dict[str, FileRecord]]:
    """The root's files grouped by the index that covers each (every root file has a
    holder: the root parser refuses any other name)."""
    grouped: dict[int, dict[str, FileRecord]] = defaultdict(dict)
    for name, record in files.items():
        holder = file_holder(name)
        if holder is not None:
            grouped[holder][name] = record
    return grouped


def _check_cells(
    name: str,
    holder: int,
    chunks: Mapping[str, list[dict[str, Any]]],
    table: TensorTable,
) -> None:
    """The index's non-empty chunks are exactly the cells the table gives it: each is
    a cell of its tensor held by this index, none twice, and there are as many as the
    table gives it over all tensors. Costs a bisection per chunk listed, never a walk
    over the table's cells (a root may name 2**24 of them in a few bytes)."""
    seen: set[tuple[str, Box]] = set()
    for fqn, entries in chunks.items():
        layout = table.tensors[fqn]
        for chunk in entries:
            box = (tuple(chunk["offsets"]), tuple(chunk["sizes"]))
            if not all(box[1]):
                continue  # an empty chunk holds no element: no cell
            if not layout.split and layout.chunks is None and layout.holders is not None:
                # Stored whole (every tensor of a one-process save): one cell, the shape.
                whole = box[1] == layout.shape and not any(box[0])
                held = layout.holders.pairs[0][0] if whole and layout.holders.pairs else None
            else:
                held = layout.cell_holder(*box)
            if held != holder or (fqn, box) in seen:
                raise IndexMismatch(
                    f"{name}: it lists a chunk of tensor {fqn[:200]!r} at {list(box[0])[:8]} "
                    f"(sizes {list(box[1])[:8]}) that the root manifest's tensor table does "
                    "not assign to it (or lists it twice): the index does not belong to this "
                    "root"
                )
            seen.add((fqn, box))
    expected = table.cells_held(holder)
    if len(seen) != expected:
        raise IndexMismatch(
            f"{name}: it lists {len(seen)} chunks holding elements; the root manifest's "
            f"tensor table gives it {expected}: the index does not belong to this root"
        )


def _check_listed_tilings(manifest: Manifest) -> None:
    """A listed (non-grid) layout must tile its shape, as a grid does by construction.

    The exact test costs ``chunks << split dimensions`` corner marks per tensor
    (:mod:`ckptvault.trust.chunk_layout`). The root gets one budget for all its listed
    tensors, as a format-2 manifest does, and its total cost is known before any mark
    is made: a root of many listed tensors each just under a one-tensor budget is
    refused at once (``manifest-inconsistent``), never ground through for hours."""
    assert manifest.tensor_table is not None
    listed = [
        (fqn, layout.shape, layout.chunks)
        for fqn, layout in manifest.tensor_table.tensors.items()
        if layout.chunks is not None
    ]
    budget = CORNER_BUDGET_BASE + CORNER_BUDGET_PER_CHUNK * sum(len(c) for _f, _s, c in listed)
    cost = sum(_corner_cost(shape, chunks) for _fqn, shape, chunks in listed)
    if cost > budget:
        raise IndexMismatch(
            f"root manifest: its {len(listed)} listed (non-grid) tensor layouts would take "
            f"{cost} corner marks to check, more than ckptvault checks ({budget}) and more "
            "than it ever writes"
        )
    for fqn, shape, chunks in listed:
        boxes = [{"offsets": list(o), "sizes": list(s)} for o, s, _h in chunks]
        problem = tiling_problem(list(shape), boxes)
        if problem is not None:
            raise IndexMismatch(f"root manifest: tensor {fqn[:200]!r}: {problem}")


def _corner_cost(
    shape: tuple[int, ...], chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...], int]]
) -> int:
    """The corner marks the tiling test makes for these (non-empty) chunks."""
    split = sum(
        1
        for dim, extent in enumerate(shape)
        if any(o[dim] != 0 or s[dim] != extent for o, s, _h in chunks)
    )
    return len(chunks) << split
