"""Hostile chunk layouts and format 3's indexes, planted in a real store as someone
who can write it but holds no signing key.

What a user relies on: every byte of a restored tensor was hashed and placed exactly
once (its chunks tile it, at any chunk count, in either format's metadata); an index
is matched against the root's digest before a byte of it is parsed, read no further
than the size the root records, and refused unread when that is over its cap; and a
root that spells out millions of cells in a few runs is checked in seconds, never by
walking its cells.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import NoValidCheckpoint
from ckptvault.format.index import MAX_INDEX_BYTES
from ckptvault.format.tensorfile import build_header, header_length, parse_header
from ckptvault.storage.posix.store import PosixStore
from ckptvault.trust import indexes as trust_indexes
from ckptvault.trust.chunk_layout import tiling_problem
from ckptvault.trust.digests import derived_file_digest
from support.common import make_training_state, writable
from support.forging import read_logical
from support.hostile_forging import (
    forge_manifest,
    forge_root,
    record_of,
    write_index,
    writer_format,
)
from support.hostile_inputs import (
    FORMATS,
    assert_verify_fails,
    deep,
    restore_skipping,
    save_two_steps,
)

INDEX = "r00000-index.json"


# -- every byte of a restored tensor was hashed, at any chunk count ----------------------

ROWS = 300  # more chunks than the old pairwise check (256) looked at


def split_into_rows(path: Path, key: str, attack: bool) -> None:
    """Re-lay tensor ``key`` (``[ROWS, 4]`` float32) as one chunk per row, each its
    own safetensors entry, as a many-rank save would. With ``attack``, row 6's chunk
    claims row 5's offsets: a duplicate and a hole, the total volume unchanged."""
    (chunk,) = read_logical(path)["dcp"]["tensors"][key]["chunks"]
    file = path / chunk["file"]
    data = file.read_bytes()
    old = parse_header(data[: header_length(data[:8], len(data), "f")], len(data), "f")
    assert list(old.entries) == [chunk["name"]]  # the file holds only this tensor
    names = [f"{key}.row{i:04d}" for i in range(ROWS)]
    new = build_header([(n, "float32", (1, 4)) for n in names], old.metadata)
    writable(file).write_bytes(new.header_bytes + data[old.data_start :])
    chunks = [
        {
            "offsets": [5 if attack and i == 6 else i, 0],
            "sizes": [1, 4],
            "file": chunk["file"],
            "name": name,
            "start": new.entries[name].start,
            "length": 16,
        }
        for i, name in enumerate(names)
    ]
    forge_manifest(path, lambda m: m["dcp"]["tensors"][key].update(chunks=chunks))


@FORMATS
@pytest.mark.parametrize("attack", [False, True])
def test_duplicate_chunk_and_hole_among_many_chunks(store, attack, version):
    """Format 3 keeps such a layout as a listed tensor table (one chunk per row, not a
    grid) whose tiling is checked; format 2 as 300 chunks in its dcp section."""
    original = torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4)
    with writer_format(version), cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"big": torch.full((ROWS, 4), -1.0)})
        path = Path(mgr.save(2, {"big": original}).result().path)
    split_into_rows(path, "big", attack)
    fresh = {"big": torch.zeros(ROWS, 4)}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(fresh)
    if not attack:  # the forged layout itself is valid: 300 chunks restore exactly
        assert info.step == 2 and info.skipped == []
        assert torch.equal(fresh["big"], original)
        return
    assert info.step == 1
    assert info.skipped[0].reason.startswith("manifest-inconsistent")
    assert "overlap and leave a gap" in info.skipped[0].reason
    assert torch.equal(fresh["big"], torch.full((ROWS, 4), -1.0))
    with cv.CheckpointManager(store, run_id="r") as mgr, pytest.raises(NoValidCheckpoint):
        mgr.restore({"big": torch.zeros(ROWS, 4)}, step=2)


def rows(count: int, width: int = 4) -> list[dict]:
    return [{"offsets": [i, 0], "sizes": [1, width]} for i in range(count)]


def test_tiling_of_a_thousand_chunks_passes():
    assert tiling_problem([1000, 4], rows(1000)) is None
    columns = [{"offsets": [0, j], "sizes": [8, 1]} for j in range(1000)]
    assert tiling_problem([8, 1000], columns) is None
    grid = [{"offsets": [i, j], "sizes": [2, 3]} for i in range(0, 50, 2) for j in range(0, 120, 3)]
    assert len(grid) == 1000 and tiling_problem([50, 120], grid) is None
    uneven = [{"offsets": [0, 0], "sizes": [7, 4]}, *rows(1000)[7:]]
    assert tiling_problem([1000, 4], uneven) is None
    assert tiling_problem([], [{"offsets": [], "sizes": []}]) is None  # a scalar
    assert tiling_problem([0, 4], [{"offsets": [0, 0], "sizes": [0, 4]}]) is None


def test_tiling_refuses_duplicates_holes_and_strays_at_any_count():
    chunks = rows(1000)
    chunks[600] = {"offsets": [599, 0], "sizes": [1, 4]}  # duplicate + hole
    assert "overlap and leave a gap" in tiling_problem([1000, 4], chunks)
    assert "overlap" in tiling_problem([1000, 4], [*rows(1000), rows(1)[0]])
    assert "gap" in tiling_problem([1000, 4], rows(999))
    assert "outside" in tiling_problem(
        [1000, 4], [*rows(999), {"offsets": [999, 1], "sizes": [1, 4]}]
    )
    assert "rank" in tiling_problem([1000, 4], [{"offsets": [0], "sizes": [1000]}])
    # In two dimensions: [0:2, 0:2] and [1:3, 1:3] share cell (1, 1); cell (2, 0)
    # is covered by nothing; the volume adds up to 16.
    shifted = [
        {"offsets": [0, 0], "sizes": [2, 2]},
        {"offsets": [1, 1], "sizes": [2, 2]},
        {"offsets": [0, 2], "sizes": [1, 2]},
        {"offsets": [1, 3], "sizes": [2, 1]},
        {"offsets": [3, 0], "sizes": [1, 4]},
    ]
    assert "overlap and leave a gap" in tiling_problem([4, 4], shifted)


def test_tiling_refuses_layouts_too_costly_to_check():
    """Split along 16 dimensions at once: 2**16 corners per chunk. Refused, not
    ground through for minutes."""
    shape = [2] * 16
    chunks = [
        {"offsets": [(n >> d) & 1 for d in range(16)], "sizes": [1] * 16} for n in range(1 << 16)
    ]
    assert "split along 16 dimensions" in tiling_problem(shape, chunks)


# -- an index is verified before it is parsed, and read no further than its record --------


def test_an_index_is_verified_before_it_is_parsed(store, monkeypatch):
    """Same size, other bytes, the root not told: the digest check refuses them before
    the index parser ever runs (deep nesting there would otherwise be parsed)."""
    paths, _ = save_two_steps(store)
    index = paths[2] / INDEX
    size = index.stat().st_size
    writable(index).write_bytes(deep(size // 2).encode() + b" " * (size % 2))
    parsed = []
    original = trust_indexes.parse_index

    def parse_index(data, holder, *args):
        parsed.append(data)
        return original(data, holder, *args)

    monkeypatch.setattr(trust_indexes, "parse_index", parse_index)
    info = restore_skipping(store, "digest-mismatch", INDEX)
    assert "does not match the root manifest's digest" in info.skipped[0].reason
    assert parsed and all(data != index.read_bytes() for data in parsed)  # step 1's only


def test_an_index_is_read_no_further_than_its_record(store, monkeypatch):
    """Bytes appended to an index are seen from the listing (size-mismatch); what is
    read of an index is never more than the root records."""
    paths, _ = save_two_steps(store)
    recorded = json.loads((paths[2] / "manifest.json").read_bytes())["indexes"][INDEX]["size"]
    limits: list[tuple[int, int]] = []
    original = PosixStore.read_bytes

    def read_bytes(self, ref, name, limit):
        if name == INDEX:
            limits.append((ref.step, limit))
        return original(self, ref, name, limit)

    monkeypatch.setattr(PosixStore, "read_bytes", read_bytes)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert mgr.restore(make_training_state(seed=9)).step == 2
    assert (2, recorded) in limits and all(limit <= MAX_INDEX_BYTES for _s, limit in limits)
    index = paths[2] / INDEX
    writable(index).write_bytes(index.read_bytes() + b" " * 4096)
    restore_skipping(store, "size-mismatch", INDEX)


def test_an_index_over_its_cap_is_refused_unread(store, monkeypatch):
    """An index of MAX_INDEX_BYTES + 1 bytes, the root recording exactly that: refused
    from the record (manifest-invalid), not a byte of it read."""
    paths, _ = save_two_steps(store)
    data = (paths[2] / INDEX).read_bytes()
    write_index(paths[2], INDEX, data + b" " * (MAX_INDEX_BYTES + 1 - len(data)))
    original = PosixStore.read_bytes

    def read_bytes(self, ref, name, limit):
        assert not (ref.step == 2 and name == INDEX), "an oversized index was read"
        return original(self, ref, name, limit)

    monkeypatch.setattr(PosixStore, "read_bytes", read_bytes)
    restore_skipping(store, "manifest-invalid", f"{MAX_INDEX_BYTES}")
    monkeypatch.undo()
    assert_verify_fails(store, "manifest-invalid")


# -- a few runs over millions of cells --------------------------------------------------

RANKS = 4096  # index files planted beside the root, one (empty) data file each


def plant_ranks(generation: Path, runs: int) -> None:
    """Rank 0's generation as 4,096 ranks: ranks 1..4095 each with an empty data file
    and an index listing it (and no chunk), and a tensor ``ghost`` of ``runs x
    4096`` one-row cells, each run of cells held by all 4,096 indexes in turn: a few
    kilobytes of holders over millions of cells. Rank 0's index holds none of them."""
    root = json.loads((generation / "manifest.json").read_bytes())
    empty = {"size": 0, "blake3": derived_file_digest(0, [])}
    for rank in range(1, RANKS):
        name = f"r{rank:05d}-000.safetensors"
        (generation / name).write_bytes(b"")
        root["files"][name] = empty
        index = {
            "files": {name: []},
            "format_version": 3,
            "generation_id": root["generation_id"],
            "holder": rank,
            "run_id": root["run_id"],
            "tensors": {},
        }
        data = json.dumps(index, separators=(",", ":"), sort_keys=True).encode()
        (generation / f"r{rank:05d}-index.json").write_bytes(data)
        root["indexes"][f"r{rank:05d}-index.json"] = record_of(data)
    cells = runs * RANKS
    root["tensors"]["ghost"] = {
        "dtype": "float32",
        "holders": [[0, RANKS]] * runs,
        "shape": [cells, 1],
        "split": [[0, [[1, cells]]]],
    }
    forge_root(generation, lambda document: document.update(root))


def plant_unmerged_runs(generation: Path, parts: int) -> None:
    """A tensor ``ghost`` of ``parts`` one-row cells, all rank 0's, its part sizes and
    holders spelled as ``parts`` runs of one each (never merged, as a writer would)."""

    def change(root: dict) -> None:
        root["tensors"]["ghost"] = {
            "dtype": "float32",
            "holders": [[0, 1]] * parts,
            "shape": [parts, 1],
            "split": [[0, [[1, 1]] * parts]],
        }

    forge_root(generation, change)


@pytest.mark.parametrize("layout", ["4,096 ranks x 4,095 runs", "60,000 unmerged part runs"])
def test_a_root_of_few_runs_over_many_cells_is_checked_in_seconds(store, layout):
    """16.7 million cells (just under the root's MAX_CELLS) in 4,095 runs of holders
    over 4,096 indexes, or 60,000 cells whose part sizes are spelled one run each:
    restore refuses either (rank 0's index holds none of the cells the table gives
    it) without walking the cells or rescanning the runs for each: checks that did
    took hours on the second (a scan of the runs before each part)."""
    paths, _ = save_two_steps(store)
    if layout.startswith("4,096"):
        plant_ranks(paths[2], runs=RANKS - 1)
    else:
        plant_unmerged_runs(paths[2], parts=60_000)
    began = time.monotonic()
    restore_skipping(store, "manifest-inconsistent", "r00000-index.json")
    assert time.monotonic() - began < 30
