"""Attacks on format 3's root and indexes by someone who can write the store but holds
no key (DESIGN rule 5): what the root's tensor table and the indexes cost a reader.

Unsigned, the root is the attacker's: a few bytes of run-length pairs can name 2**24
cells over thousands of indexes, and part runs left unmerged make a layout that any
per-cell or per-run scan turns quadratic. Each attack below was minutes to hours of
one core before the checks became bisections (each test's timeout is far below
that); the generation is refused with a reason code, the one before restores, and
nothing raw escapes. Also here: the listed layouts' shared corner budget, run
lengths past the cell budget, roots that would not be written back as stored, and
an empty chunk outside its tensor. The table's queries are checked against brute
force, since a rank of many loads only the indexes they name.
"""

from __future__ import annotations

import json
import random
import time
import tracemalloc
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import CheckpointError
from ckptvault.format.manifest import parse_manifest
from ckptvault.format.tensor_table import TensorTable, parse_tensor_table
from ckptvault.storage.posix.store import PosixStore
from ckptvault.trust.checks import check_structure
from ckptvault.trust.digests import derived_file_digest
from support.common import make_training_state
from support.format3_plants import (
    _guillotine,
    _plant_holders,
    _random_layout,
    read_root,
    restore_skipping,
    verify_codes,
    write_index,
    write_root,
)


@pytest.fixture
def two_steps(store: Path) -> tuple[Path, Path]:
    """Steps 1 and 2 of an unsigned run; the attacks target step 2."""
    with cv.CheckpointManager(store, run_id="r") as mgr:
        one = Path(mgr.save(1, make_training_state(seed=1)).result().path)
        two = Path(mgr.save(2, make_training_state(seed=2)).result().path)
    return one, two












# -- the tensor table's costs ---------------------------------------------------------


@pytest.mark.timeout(120)
def test_unmerged_part_runs_cost_a_bisection_per_chunk_not_a_scan(two_steps):
    """150,000 parts of alternating sizes 1 and 2 (no two runs merge), each its own
    holder run: the index's cells were found by summing every earlier run for each
    cell (150,000**2 / 2 steps, hours). Now refused in about a second."""
    store = two_steps[1].parent
    root = read_root(two_steps[1])
    parts = [[1, 1], [2, 1]] * 75_000
    root["tensors"]["model/fc1.weight"] = {
        "dtype": "float32",
        "holders": [[0, 1]] * len(parts),
        "shape": [sum(size for size, _count in parts), 8],  # the index's chunk fits in it
        "split": [[0, parts]],
    }
    write_root(two_steps[1], root)
    started = time.monotonic()
    restore_skipping(store, "manifest-inconsistent", "does not assign to it")
    assert time.monotonic() - started < 30




@pytest.mark.timeout(180)
def test_thousands_of_consistent_indexes_cost_what_they_list(two_steps):
    """4,000 indexes over 100,000 holder runs, each index consistent with the root:
    each index's cells were found by scanning every run (4e8 steps) and its files by
    matching every file name of the root (1.6e7 regex matches). Each index now costs
    a bisection per chunk it lists; the planted empty files are refused."""
    _plant_holders(two_steps[1], holders=4_000, cells=100_000)
    started = time.monotonic()
    restore_skipping(two_steps[1].parent, "tensor-file-invalid")
    assert time.monotonic() - started < 60


@pytest.mark.timeout(120)
def test_a_grid_of_2_24_cells_answers_holders_of_by_its_runs():
    """A 4096 x 4096 grid of one-element cells (2**24, the table's whole budget) in a
    few kilobytes of runs: which indexes hold a box used to list every position in
    it (a whole-tensor read: 2**24 Python ints, about a gigabyte)."""
    raw = {
        "w": {
            "dtype": "float32",
            "holders": [[0, 4096]] * 4096,
            "shape": [4096, 4096],
            "split": [[0, [[1, 4096]]], [1, [[1, 4096]]]],
        }
    }
    layout = parse_tensor_table(raw, list(range(4096)), "test").tensors["w"]
    tracemalloc.start()
    started = time.monotonic()
    try:
        assert layout.holders_of((0, 0), (4096, 4096)) == set(range(4096))
        assert layout.holders_of((0, 7), (4096, 1)) == {7}  # one column: a span per row
        assert layout.holders_of((5, 0), (1, 4096)) == set(range(4096))
        assert layout.holders_of((9, 9), (2, 3)) == {9, 10, 11}
        assert layout.all_holders() == set(range(4096))
        assert layout.cell_holder((4095, 4095), (1, 1)) == 4095
        assert TensorTable({"w": layout}).cells_held(17) == 4096
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert time.monotonic() - started < 20 and peak < 64 << 20, peak




def test_listed_layouts_share_one_corner_budget(two_steps):
    """Eight listed layouts that each tile and each cost 2**19 corner marks, under the
    one-tensor budget (2**21): checked one by one they took seconds each, and a 32 MiB
    root holds thousands. The root has one budget, as a format-2 manifest has, and
    its cost is known before any mark is made."""
    root = read_root(two_steps[1])
    boxes = _guillotine(14)
    layout = {"chunks": boxes, "dtype": "float32", "shape": [2] * 14}
    assert parse_tensor_table({"t": layout}, [0], "test").tensors["t"].cell_count == 32
    root["tensors"].update({f"planted/{n}": layout for n in range(8)})
    write_root(two_steps[1], root)
    started = time.monotonic()
    restore_skipping(two_steps[1].parent, "manifest-inconsistent", "more than ckptvault checks")
    assert time.monotonic() - started < 10


@pytest.mark.parametrize(
    "table",
    [
        {"holders": [[0, 2**60]], "shape": [2**20]},  # a count far past any grid
        {"holders": [[0, 1]], "shape": [2**40], "split": [[0, [[1, 2**40]]]]},
        # 8192 x 8192 cells: each run fine, their product past the 2**24 budget.
        {
            "holders": [[0, 1]] * 4,
            "shape": [8192, 8192],
            "split": [[0, [[1, 8192]]], [1, [[1, 8192]]]],
        },
        {"holders": [[0, 1], [0, 1]], "shape": [4]},  # more cells than the grid has
        {"holders": [[5, 1]], "shape": [4]},  # an index the root does not list
        {"holders": [[0, 1]], "shape": [4], "split": [[0, [[3, 1]]]]},  # parts short of 4
    ],
)
def test_run_lengths_past_the_budget_or_the_grid_are_refused_before_expanding(two_steps, table):
    root = read_root(two_steps[1])
    root["tensors"]["model/fc1.bias"] = {"dtype": "float32", **table}
    write_root(two_steps[1], root)
    started = time.monotonic()
    restore_skipping(two_steps[1].parent, "manifest-invalid")
    assert time.monotonic() - started < 10




def test_the_tables_queries_agree_with_every_cell_enumerated():
    """A rank of many loads the indexes ``holders_of`` names for its boxes, and an
    index passes when its chunks are the cells ``cell_holder`` gives it and as many as
    ``cells_held`` counts: each must be exact, or a rank would restore a box with a
    hole (never filled, never noticed). Checked against brute force over every cell,
    on random grids with unmerged runs."""
    rng = random.Random(3)
    for _ in range(1500):
        layout = _random_layout(rng)
        holder_of = {}
        for (first, count), start in zip(layout.holders.pairs, layout.holders.starts, strict=True):
            for i in range(count):
                holder_of[layout._cell_box(start + i)] = first + i
        volume = sum(torch.Size(sizes).numel() for _offsets, sizes in holder_of)
        assert volume == torch.Size(layout.shape).numel()  # the grid tiles its shape
        for (offsets, sizes), holder in holder_of.items():
            assert layout.cell_holder(offsets, sizes) == holder
        for _ in range(8):
            offsets = [rng.randint(0, extent - 1) for extent in layout.shape]
            sizes = [
                rng.randint(1, extent - o) for o, extent in zip(offsets, layout.shape, strict=True)
            ]
            box = (tuple(offsets), tuple(sizes))
            assert (box in holder_of) == (layout.cell_holder(*box) is not None)
            expected = {
                holder
                for (o, s), holder in holder_of.items()
                if all(
                    a < b + t and b < a + c for a, c, b, t in zip(o, s, offsets, sizes, strict=True)
                )
            }
            assert layout.holders_of(offsets, sizes) == expected, (layout, offsets, sizes)
        assert layout.all_holders() == set(holder_of.values())
        table = TensorTable({"a": layout, "b": _random_layout(rng)})
        for holder in range(7):
            cells = sum(len(list(t.cells_of(holder))) for t in table.tensors.values())
            assert table.cells_held(holder) == cells


# -- the root as stored is the root written back ---------------------------------------


def test_a_parsed_root_writes_back_its_exact_bytes(store: Path, tmp_path: Path):
    """Plain, with metrics, and encrypted: ``to_bytes`` of a parsed root, and of the
    manifest once its indexes are loaded, is the root's stored bytes."""
    with cv.CheckpointManager(store, run_id="r") as mgr:
        plain = Path(mgr.save(1, make_training_state(), metrics={"loss": 0.5}).result().path)
    secret = tmp_path / "secret"
    with cv.CheckpointManager(secret, run_id="e", keystore=tmp_path / "keys") as mgr:
        encrypted = Path(mgr.save(1, make_training_state()).result().path)
    for generation in (plain, encrypted):
        data = (generation / "manifest.json").read_bytes()
        assert parse_manifest(data, "test").to_bytes() == data
        # With its indexes loaded (chunk digests, chunks) it is still that root.
        posix = PosixStore(generation.parent)
        (ref,) = posix.list_generations()
        assert check_structure(posix, ref).manifest.to_bytes() == data


@pytest.mark.parametrize(
    "change",
    [
        lambda root: root.pop("parent"),
        lambda root: root.pop("dcp_version"),
        lambda root: root.update(metrics=None),
        lambda root: root.update(encryption=None),
    ],
    ids=["no parent", "no dcp_version", "null metrics", "null encryption"],
)
def test_a_root_that_would_be_written_back_otherwise_is_refused(two_steps, change):
    """Each of these parsed, and ``to_bytes`` gave other bytes than the ones checked."""
    root = read_root(two_steps[1])
    change(root)
    write_root(two_steps[1], root)
    restore_skipping(two_steps[1].parent, "manifest-invalid", "not in the form ckptvault writes")


def test_an_empty_chunk_outside_its_tensor_is_refused(two_steps):
    """An empty chunk is no cell of the table, so the cell check never sees it; formats
    1-2 refuse any chunk outside the shape, and so does an index."""
    generation = two_steps[1]
    root = read_root(generation)
    index = json.loads((generation / "r00000-index.json").read_bytes())
    chunks = index["tensors"]["model/fc1.weight"]
    file = chunks[0][2]
    chunks.append([[1000, 0], [0, 8], file, "model/fc1.weight", chunks[0][4], 0])
    write_index(generation, root, index)
    write_root(generation, root)
    restore_skipping(generation.parent, "manifest-invalid", "stay inside its shape")
    assert verify_codes(generation.parent) == {1: set(), 2: {"manifest-invalid"}}


def test_indexes_adding_up_past_the_generation_bound_are_refused_unread(two_steps, monkeypatch):
    """65 indexes recorded at 64 MiB each, every one within its own bound: a reader
    that loads them all keeps about 11 bytes a byte parsed (empty chunks, digests of
    a 1-byte chunk size), ~45 GB. The root is refused before any index is read, and
    the writer refuses to publish such a root."""
    generation = two_steps[1]
    root = read_root(generation)
    for holder in range(1, 65):
        name = f"r{holder:05d}-000.safetensors"
        (generation / name).write_bytes(b"")
        root["files"][name] = {"blake3": derived_file_digest(0, ()), "size": 0}
    for holder in range(65):
        root["indexes"][f"r{holder:05d}-index.json"] = {"blake3": "0" * 64, "size": 64 << 20}
    write_root(generation, root)
    restore_skipping(generation.parent, "manifest-invalid", "a generation's indexes may take")

    monkeypatch.setattr("ckptvault.format.manifest.MAX_INDEXES_TOTAL_BYTES", 100)
    with (
        cv.CheckpointManager(generation.parent, run_id="r") as mgr,
        pytest.raises(CheckpointError, match="indexes may take"),
    ):
        mgr.save(3, make_training_state(seed=3))
    assert sorted(p.name.split(".")[0] for p in generation.parent.glob("step-*")) == [
        "step-000000000001",
        "step-000000000002",
    ]
