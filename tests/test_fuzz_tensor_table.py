"""Fuzzing the root manifest's tensor table (``ckptvault.format.tensor_table``): what
a format-3 reader knows of every tensor before it reads any index, and what decides
which indexes a rank reads and which chunks an index must hold.

- Build -> parse: for random chunk layouts as a save produces them (grids of any
  cuts along any dimensions, held by any ranks, with empty chunks among them, in any
  order; and irregular guillotine partitions that are no grid),
  ``build_tensor_table`` gives a table that parses back to the same JSON, lists
  only layouts the tiling check accepts, and whose queries agree with a naive
  computation from the chunks themselves: ``cells_of`` (the cells an index holds),
  ``cell_holder`` (who holds a box), ``cells_held`` (how many), ``all_holders`` and
  ``holders_of`` (who holds any cell overlapping a box).
- Hostile tables: JSON-level edits of built tables and arbitrary JSON, with any list
  of index ordinals, and grids spelled from the run-length encoding up (any part
  sizes, runs merged or not, any holder runs) are refused with a ckptvault error or
  parse to a table whose JSON is exactly the input and whose queries agree with the
  naive expansion of its run-length encoding; memory never out of proportion to the
  input.
- A few runs over 2**24 cells: every query costs what the runs cost.
"""

from __future__ import annotations

import itertools
import math
import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.layout import file_holder
from ckptvault.format.tensor_table import (
    MAX_CELLS,
    TensorTable,
    build_tensor_table,
    parse_tensor_table,
)
from ckptvault.trust.chunk_layout import tiling_problem
from fuzzing import fuzz_settings, hostile_json, measured, mutated_json, refused, scenario

pytestmark = [pytest.mark.fuzz, pytest.mark.reliability]

Cell = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, holder


def chunk(offsets: tuple[int, ...], sizes: tuple[int, ...], holder: int) -> dict[str, Any]:
    return {"offsets": list(offsets), "sizes": list(sizes), "file": f"r{holder:05d}-000.st"}


# -- layouts as a save produces them ----------------------------------------------------


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


def test_tensor_table_build_parse_round_trip():
    tensors = st.dictionaries(
        st.text(max_size=8), grid_tensors() | guillotine_tensors(), min_size=1, max_size=4
    )
    with scenario("fuzz: tensor table, build -> parse and queries") as trials:

        @fuzz_settings(ci=200, long=10_000)
        @given(tensors, st.data())
        def round_trip(tensors: dict[str, Any], data: st.DataObject) -> None:
            trials.count()
            table = build_tensor_table(tensors, lambda name: file_holder(name) or 0)
            document = table.to_json()
            cells = {fqn: naive_cells(info) for fqn, info in tensors.items()}
            holders = sorted({h for found in cells.values() for _o, _s, h in found})
            parsed = parse_tensor_table(document, holders, "fuzz")
            assert dumps_canonical(parsed.to_json()) == dumps_canonical(document)
            for _fqn, info in document.items():
                if "chunks" in info:  # listed: only a tiling the reader accepts
                    boxes = [{"offsets": o, "sizes": s} for o, s, _h in info["chunks"]]
                    assert tiling_problem(info["shape"], boxes) is None, info
                trials.outcome("listed" if "chunks" in info else "grid")
            check_queries(
                parsed, cells, lambda shape: data.draw(st.lists(query_boxes(shape), max_size=4))
            )

        round_trip()


# -- hostile tables ---------------------------------------------------------------------


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


@pytest.fixture(scope="module")
def built_tables() -> list[dict[str, Any]]:
    """Tables as a save writes them: shards of 1,024 ranks, a grid in two
    dimensions, a listed layout, a scalar, an empty tensor."""
    rows = [chunk((4 * r, 0), (4, 8), r) for r in range(1024)]
    tiles = [chunk((i, j), (1, 2), 2 * i + j // 2) for i in range(3) for j in (0, 2)]
    odd = [chunk((0, 0), (2, 2), 0), chunk((0, 2), (4, 2), 1), chunk((2, 0), (2, 2), 2)]
    tensors = {
        "rows": {"dtype": "float32", "shape": [4096, 8], "chunks": rows},
        "tiles": {"dtype": "int8", "shape": [3, 4], "chunks": tiles},
        "odd": {"dtype": "float16", "shape": [4, 4], "chunks": odd},
        "step": {"dtype": "int64", "shape": [], "chunks": [chunk((), (), 0)]},
        "none": {"dtype": "float32", "shape": [0, 3], "chunks": [chunk((0, 0), (0, 3), 1)]},
    }
    table = build_tensor_table(tensors, lambda name: file_holder(name) or 0).to_json()
    return [table, {k: table[k] for k in ("tiles", "odd", "step")}]


def test_tensor_table_parser_refuses_hostile_tables_with_typed_errors(built_tables):
    tables = st.sampled_from(built_tables)
    documents = (
        tables.flatmap(lambda table: mutated_json(table, max_ops=1))
        | tables.flatmap(mutated_json)
        | hostile_json
    )
    ordinals = st.lists(st.integers(0, 1100), max_size=6).map(sorted) | st.just(list(range(1024)))
    cases = st.tuples(documents, ordinals) | encoded_tables()
    with scenario("fuzz: tensor table parser, hostile tables") as trials:

        @fuzz_settings(ci=300, long=10_000)
        @given(cases, st.data())
        def hostile(case: tuple[Any, list[int]], data: st.DataObject) -> None:
            document, holders = case
            trials.count()
            raw = dumps_canonical_or_none(document)
            if raw is None:
                trials.outcome("not JSON")
                return
            outcome = measured(parse_tensor_table, document, holders, "fuzz")
            assert outcome.peak <= 64 * len(raw) + (4 << 20), f"{len(raw)} bytes: {outcome.peak}"
            if outcome.error is not None:
                refused(trials, outcome.error)
                return
            table = outcome.value
            trials.outcome("accepted")
            assert dumps_canonical(table.to_json()) == raw  # exactly what it says
            small = {
                fqn: info for fqn, info in document.items() if table.tensors[fqn].cell_count <= 4096
            }
            cells = {fqn: expanded(info) for fqn, info in small.items()}
            assert all({h for _o, _s, h in found} <= set(holders) for found in cells.values())
            if len(small) == len(document):
                check_queries(
                    table, cells, lambda shape: data.draw(st.lists(query_boxes(shape), max_size=3))
                )

        hostile()


def dumps_canonical_or_none(document: Any) -> bytes | None:
    """The document's canonical bytes (None when it holds text no parser builds:
    the mutations' raw tokens, lone surrogates)."""
    try:
        return dumps_canonical(document)
    except Exception:
        return None


# -- a few runs over millions of cells -------------------------------------------------


def test_queries_of_a_table_of_millions_of_cells_cost_what_its_runs_cost():
    """4,096 ranks x 4,096 runs of one-row cells (2**24, MAX_CELLS) in one tensor, and a
    tensor of 60,000 unmerged part runs: parsing and every query take about what the
    runs take to read, never a walk over the cells."""
    ranks = 4096
    table = {
        "wide": {
            "dtype": "float32",
            "shape": [MAX_CELLS // 2, 2],
            "split": [[0, [[1, MAX_CELLS // 2]]], [1, [[1, 2]]]],
            "holders": [[0, ranks]] * (MAX_CELLS // ranks),
        }
    }
    unmerged = {
        "dtype": "float32",
        "shape": [60_000, 1],
        "split": [[0, [[1, 1]] * 60_000]],
        "holders": [[0, 1]] * 60_000,
    }
    began = time.monotonic()
    wide = parse_tensor_table(table, list(range(ranks)), "big").tensors["wide"]
    outcome = measured(
        lambda: (
            wide.all_holders(),
            wide.holders_of([0, 0], [MAX_CELLS // 2, 2]),
            wide.holders_of([MAX_CELLS // 4, 1], [3, 1]),
            wide.cell_holder([MAX_CELLS // 2 - 1, 1], [1, 1]),
            sum(1 for _ in wide.cells_of(17)),
        )
    )
    assert outcome.error is None, outcome.error
    everyone, overlapping, few, last, seventeen = outcome.value
    assert everyone == overlapping == set(range(ranks))
    assert few == {(2 * row + 1) % ranks for row in range(MAX_CELLS // 4, MAX_CELLS // 4 + 3)}
    assert last == ranks - 1 and seventeen == MAX_CELLS // ranks
    assert outcome.peak < 32 << 20, outcome.peak
    parsed = parse_tensor_table({"unmerged": unmerged}, [0], "big")
    assert parsed.cells_held(0) == 60_000
    layout = parsed.tensors["unmerged"]
    assert layout.cell_holder([59_999, 0], [1, 1]) == 0 and layout.holders_of(
        [0, 0], [60_000, 1]
    ) == {0}
    assert sum(1 for _ in layout.cells_of(0)) == 60_000
    assert time.monotonic() - began < 30
