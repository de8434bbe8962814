"""Tensor tables expanded naively, cell by cell, to check the real queries against."""

from __future__ import annotations

import itertools
import math
from typing import Any

from hypothesis import strategies as st

from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.layout import file_holder
from ckptvault.format.tensor_table import (
    TensorTable,
)

Cell = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, holder


def chunk(offsets: tuple[int, ...], sizes: tuple[int, ...], holder: int) -> dict[str, Any]:
    return {"offsets": list(offsets), "sizes": list(sizes), "file": f"r{holder:05d}-000.st"}


@st.composite
def grid_tensors(draw: st.DrawFn) -> dict[str, Any]:
    """A tensor cut along some dimensions at random points, each cell held by one
    rank (its own, one for all, or any), with empty chunks mixed in, shuffled."""
    rank = draw(st.integers(0, 3))
    shape = draw(st.lists(st.integers(0, 9), min_size=rank, max_size=rank))
    parts = []
    for extent in shape:
        cuts = draw(st.sets(st.integers(1, extent - 1), max_size=4)) if extent > 1 else set()
        parts.append(list(itertools.pairwise([0, *sorted(cuts), extent])))
    scheme = draw(st.sampled_from(["own", "one", "any"]))
    chunks = []
    for position, spans in enumerate(itertools.product(*parts)):
        offsets = tuple(low for low, _high in spans)
        sizes = tuple(high - low for low, high in spans)
        holder = position if scheme == "own" else 3 if scheme == "one" else draw(st.integers(0, 5))
        chunks.append(chunk(offsets, sizes, holder))
    if rank:  # empty shards: a rank that holds nothing of this tensor still lists one
        for _ in range(draw(st.integers(0, 2))):
            dim = draw(st.integers(0, rank - 1))
            offsets = tuple(draw(st.integers(0, extent)) for extent in shape)
            sizes = tuple(0 if d == dim else shape[d] - offsets[d] for d in range(rank))
            chunks.append(chunk(offsets, sizes, draw(st.integers(0, 5))))
    return {"dtype": "float32", "shape": shape, "chunks": draw(st.permutations(chunks))}


@st.composite
def guillotine_tensors(draw: st.DrawFn) -> dict[str, Any]:
    """A tensor cut into boxes by recursive cuts across one dimension at a time:
    always a tiling, usually no grid."""
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 8), min_size=rank, max_size=rank)))
    boxes = [((0,) * rank, shape)]
    for _ in range(draw(st.integers(0, 6))):
        index = draw(st.integers(0, len(boxes) - 1))
        offsets, sizes = boxes[index]
        dims = [d for d in range(rank) if sizes[d] > 1]
        if not dims:
            continue
        dim = draw(st.sampled_from(dims))
        cut = draw(st.integers(1, sizes[dim] - 1))
        low = (offsets, (*sizes[:dim], cut, *sizes[dim + 1 :]))
        high_offsets = (*offsets[:dim], offsets[dim] + cut, *offsets[dim + 1 :])
        high = (high_offsets, (*sizes[:dim], sizes[dim] - cut, *sizes[dim + 1 :]))
        boxes[index : index + 1] = [low, high]
    chunks = [chunk(o, s, draw(st.integers(0, 4))) for o, s in boxes]
    return {"dtype": "bfloat16", "shape": list(shape), "chunks": draw(st.permutations(chunks))}


def naive_cells(info: dict[str, Any]) -> list[Cell]:
    """A dcp tensor's cells, from its chunks alone: every chunk holding an element."""
    return [
        (tuple(c["offsets"]), tuple(c["sizes"]), file_holder(c["file"]) or 0)
        for c in info["chunks"]
        if math.prod(c["sizes"])
    ]


def overlaps(offsets: tuple[int, ...], sizes: tuple[int, ...], box: tuple[list, list]) -> bool:
    return all(
        a < b + t and b < a + s for a, s, b, t in zip(offsets, sizes, box[0], box[1], strict=True)
    )


def naive_holders_of(cells: list[Cell], rank: int, box: tuple[list, list]) -> set[int]:
    """Who holds a cell overlapping ``box``: none for a box of no element; all for a
    box of another rank (a reader that cannot tell must read every index holding the
    tensor)."""
    if len(box[0]) != rank or len(box[1]) != rank:
        return {h for _o, _s, h in cells}
    if not math.prod(box[1]):
        return set()
    return {h for o, s, h in cells if overlaps(o, s, box)}


@st.composite
def query_boxes(draw: st.DrawFn, shape: list[int]) -> tuple[list[int], list[int]]:
    """A box a reader may ask about: anywhere in or beside the shape, empty or not,
    now and then of another rank."""
    rank = len(shape) if draw(st.integers(0, 9)) else draw(st.integers(0, 4))
    extents = [*shape, 4, 4, 4, 4][:rank]
    offsets = [draw(st.integers(0, extent + 1)) for extent in extents]
    sizes = [draw(st.integers(0, extent + 1)) for extent in extents]
    return offsets, sizes


def check_queries(table: TensorTable, cells_by_fqn: dict[str, list[Cell]], boxes: Any) -> None:
    """Every query of ``table`` agrees with the naive cells of each tensor (for at most
    a dozen of the indexes holding them, and two more)."""
    holding = sorted({h for cells in cells_by_fqn.values() for _o, _s, h in cells})
    listed = sorted({*holding[:6], *holding[-6:], 0, 7})
    for fqn, cells in cells_by_fqn.items():
        layout = table.tensors[fqn]
        assert layout.cell_count == len(cells)
        assert layout.all_holders() == {h for _o, _s, h in cells}
        for holder in listed:
            mine = sorted((o, s) for o, s, h in cells if h == holder)
            assert sorted(layout.cells_of(holder)) == mine, (fqn, holder)
        if len({(o, s) for o, s, _h in cells}) == len(cells):  # no box listed twice
            for offsets, sizes, holder in cells:
                assert layout.cell_holder(offsets, sizes) == holder
        for box in boxes(layout.shape):
            assert layout.holders_of(*box) == naive_holders_of(cells, len(layout.shape), box)
            as_cell = [h for o, s, h in cells if (o, s) == (tuple(box[0]), tuple(box[1]))]
            if len(as_cell) <= 1:
                assert layout.cell_holder(*box) == (as_cell[0] if as_cell else None), box
    for holder in listed:
        held = sum(1 for cells in cells_by_fqn.values() for _o, _s, h in cells if h == holder)
        assert table.cells_held(holder) == held, holder


def expanded(info: dict[str, Any]) -> list[Cell]:
    """A parsed layout's cells, from its JSON's run-length encoding, expanded naively:
    each split dimension's parts one by one, the cells in row-major order, the
    holders one per cell."""
    shape = info["shape"]
    if "chunks" in info:
        return [(tuple(o), tuple(s), h) for o, s, h in info["chunks"]]
    if not math.prod(shape):
        return []
    split = {
        dim: [size for size, count in runs for _ in range(count)]
        for dim, runs in info.get("split", [])
    }
    parts = []
    for dim, extent in enumerate(shape):
        sizes = split.get(dim, [extent])
        starts = list(itertools.accumulate([0, *sizes[:-1]]))
        parts.append(list(zip(starts, sizes, strict=True)))
    holders = [first + i for first, count in info["holders"] for i in range(count)]
    grid = [
        (tuple(start for start, _size in cell), tuple(size for _start, size in cell))
        for cell in itertools.product(*parts)
    ]
    assert len(grid) == len(holders)
    return [(o, s, h) for (o, s), h in zip(grid, holders, strict=True)]


@st.composite
def run_lengths(draw: st.DrawFn, total: int, low: int) -> list[list[int]]:
    """``total`` cut into runs ``[[value, count], ...]`` spelled as a writer would not
    always spell them (neighbouring runs of one value left unmerged)."""
    runs, left = [], total
    while left:
        count = draw(st.integers(1, left))
        runs.append([draw(st.integers(low, low + 3)), count])
        left -= count
    return runs


@st.composite
def encoded_tables(draw: st.DrawFn) -> tuple[dict[str, Any], list[int]]:
    """Grid layouts as the root spells them, from the run-length encoding up: any part
    sizes along any dimensions, any holder runs; and the index ordinals they need."""
    rank = draw(st.integers(0, 3))
    shape = draw(st.lists(st.integers(0, 12), min_size=rank, max_size=rank))
    split = []
    for dim, extent in enumerate(shape):
        if extent and draw(st.booleans()):
            sizes = []
            while sum(sizes) < extent:
                sizes.append(draw(st.integers(1, extent - sum(sizes))))
            runs: list[list[int]] = []
            for size in sizes:  # equal neighbours merged, or not
                if runs and runs[-1][0] == size and draw(st.booleans()):
                    runs[-1][1] += 1
                else:
                    runs.append([size, 1])
            split.append([dim, runs])
    cells = math.prod(len(runs) for _d, runs in split) if math.prod(shape) else 0
    holders = draw(run_lengths(cells, 0))
    info: dict[str, Any] = {"dtype": "float32", "shape": shape, "holders": holders}
    if split:
        info["split"] = split
    ordinals = sorted({first + i for first, count in holders for i in range(count)})
    return {"t": info}, ordinals


def dumps_canonical_or_none(document: Any) -> bytes | None:
    """The document's canonical bytes (None when it holds text no parser builds:
    the mutations' raw tokens, lone surrogates)."""
    try:
        return dumps_canonical(document)
    except Exception:
        return None

