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
from ckptvault.format.tensor_table import Box, TensorLayout
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.chunk_layout import tiling_problem
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
    by_holder = _holders_of_tensors(manifest.tensor_table.tensors, names) if names else {}
    for name in names:
        holder = file_holder(name)
        assert holder is not None
        covered = {n: r for n, r in manifest.files.items() if file_holder(n) == holder}
        data = _read_index(store, ref, name, manifest)
        shapes = {fqn: layout.shape for fqn, layout in manifest.tensor_table.tensors.items()}
        where = f"generation {ref.generation_id}"
        contents = parse_index(
            data, holder, manifest.run_id, manifest.generation_id, covered, shapes, where
        )
        for file, digests in contents.file_chunks.items():
            files[file] = _checked_record(name, file, covered[file], digests, manifest.chunk_size)
        _check_cells(name, holder, contents.chunks, manifest.tensor_table.tensors, by_holder)
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
            holders.update(layout.holder_ids())
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


def _holders_of_tensors(
    tensors: Mapping[str, TensorLayout], names: Sequence[str]
) -> dict[int, list[str]]:
    """For each index being loaded, the tensors the table gives it cells of."""
    loading = {file_holder(name) for name in names}
    found: dict[int, list[str]] = defaultdict(list)
    for fqn, layout in tensors.items():
        for holder in set(layout.holder_ids()) & loading:
            assert holder is not None
            found[holder].append(fqn)
    return found


def _check_cells(
    name: str,
    holder: int,
    chunks: Mapping[str, list[dict[str, Any]]],
    tensors: Mapping[str, TensorLayout],
    by_holder: Mapping[int, list[str]],
) -> None:
    """The index's non-empty chunks are exactly the cells the table gives it."""
    expected_fqns = set(by_holder.get(holder, ()))
    for fqn in sorted(expected_fqns | set(chunks)):
        boxes = [
            (tuple(c["offsets"]), tuple(c["sizes"])) for c in chunks.get(fqn, ()) if all(c["sizes"])
        ]
        expected = _expected_cells(tensors[fqn], holder) if fqn in expected_fqns else []
        if len(boxes) != len(set(boxes)) or sorted(boxes) != sorted(expected):
            raise IndexMismatch(
                f"{name}: the chunks it lists of tensor {fqn[:200]!r} are not the ones the root "
                "manifest assigns to it"
            )


def _expected_cells(layout: TensorLayout, holder: int) -> list[Box]:
    if not layout.split and layout.holders is not None and layout.holders.pairs == ((holder, 1),):
        return [((0,) * len(layout.shape), layout.shape)]  # a tensor stored whole: no grid
    return list(layout.cells_of(holder))


def _check_listed_tilings(manifest: Manifest) -> None:
    """A listed (non-grid) layout must tile its shape, as a grid does by construction."""
    assert manifest.tensor_table is not None
    for fqn, layout in manifest.tensor_table.tensors.items():
        if layout.chunks is None:
            continue
        boxes = [{"offsets": list(o), "sizes": list(s)} for o, s, _h in layout.chunks]
        problem = tiling_problem(list(layout.shape), boxes)
        if problem is not None:
            raise IndexMismatch(f"root manifest: tensor {fqn[:200]!r}: {problem}")
