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

import time
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.layout import file_holder
from ckptvault.format.tensor_table import (
    MAX_CELLS,
    build_tensor_table,
    parse_tensor_table,
)
from ckptvault.trust.chunk_layout import tiling_problem
from support.fuzzing import fuzz_settings, hostile_json, measured, mutated_json, refused, scenario
from support.tensor_cells import (
    check_queries,
    chunk,
    dumps_canonical_or_none,
    encoded_tables,
    expanded,
    grid_tensors,
    guillotine_tensors,
    naive_cells,
    query_boxes,
)

pytestmark = [pytest.mark.fuzz, pytest.mark.reliability]





# -- layouts as a save produces them ----------------------------------------------------
















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
