"""Planting format-3 roots and indexes, for the attacks on the two-level manifest."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from blake3 import blake3

import ckptvault as cv
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.tensor_table import Runs, TensorLayout
from ckptvault.trust.digests import derived_file_digest
from support.common import make_training_state, run_cli, writable

RAW_ERRORS = (RecursionError, OverflowError, MemoryError, RuntimeError, ValueError, KeyError)


def write_root(generation: Path, root: dict[str, Any]) -> bytes:
    """Store ``root`` (without its self-digest) as the generation's root manifest,
    self-digest recomputed: all an attacker without a key needs."""
    root = {k: v for k, v in root.items() if k != "manifest_blake3"}
    root["manifest_blake3"] = blake3(dumps_canonical(root)).hexdigest()
    data = dumps_canonical(root)
    writable(generation / "manifest.json").write_bytes(data)
    return data


def read_root(generation: Path) -> dict[str, Any]:
    return json.loads((generation / "manifest.json").read_bytes())


def write_index(generation: Path, root: dict[str, Any], index: dict[str, Any]) -> None:
    """Store ``index`` as its holder's index and record it in ``root`` (not written)."""
    data = dumps_canonical(index)
    name = f"r{index['holder']:05d}-index.json"
    path = generation / name
    if path.exists():
        writable(path)
    path.write_bytes(data)
    root["indexes"][name] = {"size": len(data), "blake3": blake3(data).hexdigest()}


def restore_skipping(store: Path, code: str, fragment: str = "") -> cv.RestoreInfo:
    """Restore skips step 2 with ``code`` and restores step 1, raising nothing raw."""
    try:
        with cv.CheckpointManager(store, run_id="r") as mgr:
            info = mgr.restore(make_training_state(seed=9))
    except RAW_ERRORS as exc:  # pragma: no cover - the failure this file exists for
        pytest.fail(f"restore let a raw {type(exc).__name__} escape: {exc}")
    assert info is not None and info.step == 1
    assert [(s.step, s.reason.split(":")[0]) for s in info.skipped] == [(2, code)], info.skipped
    assert fragment in info.skipped[0].reason, info.skipped[0].reason
    return info


def verify_codes(store: Path) -> dict[int, set[str]]:
    result = run_cli("verify", str(store), "--all", "--json")
    assert "Traceback" not in result.stderr, result.stderr[-2000:]
    return {r["step"]: {p["code"] for p in r["problems"]} for r in json.loads(result.stdout)}


def _plant_holders(generation: Path, holders: int, cells: int) -> None:
    """``holders - 1`` more indexes, each over one empty file, and a tensor of
    ``cells`` one-row cells dealt to them in turn, one holder run per cell: every
    index is consistent with the root, so each is loaded and checked."""
    root = read_root(generation)
    empty = derived_file_digest(0, ())
    dealt: dict[int, list[int]] = {holder: [] for holder in range(1, holders)}
    for cell in range(cells):
        dealt[1 + cell % (holders - 1)].append(cell)
    for holder, positions in dealt.items():
        name = f"r{holder:05d}-000.safetensors"
        (generation / name).write_bytes(b"")
        root["files"][name] = {"blake3": empty, "size": 0}
        chunks = [[[p, 0], [1, 4], name, f"planted/{p}", 0, 16] for p in positions]
        index = {
            "files": {name: []},
            "format_version": 3,
            "generation_id": root["generation_id"],
            "holder": holder,
            "run_id": root["run_id"],
            "tensors": {"planted": chunks},
        }
        write_index(generation, root, index)
    root["tensors"]["planted"] = {
        "dtype": "float32",
        "holders": [[1 + cell % (holders - 1), 1] for cell in range(cells)],
        "shape": [cells, 4],
        "split": [[0, [[1, cells]]]],
    }
    write_root(generation, root)


def _guillotine(rank: int) -> list[list[Any]]:
    """32 boxes tiling ``[2] * rank`` (rank 14), cut in halves five levels deep with a
    different dimension at each node: every dimension is split somewhere, so the
    exact tiling test makes ``32 << 14`` corner marks, under one tensor's budget."""
    boxes: list[list[Any]] = []

    def cut(offsets: list[int], sizes: list[int], level: int, node: int, used: set[int]) -> None:
        if level == 5:
            boxes.append([offsets, sizes, 0])
            return
        dim = [0, 1 + node, 3 + node, 7 + node % 7, 3 + (node // 4 + 1) % 4][level]
        assert dim not in used and dim < rank
        for half in (0, 1):
            o, s = list(offsets), list(sizes)
            o[dim], s[dim] = half, 1
            cut(o, s, level + 1, 2 * node + half, used | {dim})

    cut([0] * rank, [2] * rank, 0, 0, set())
    return boxes


def _random_layout(rng: random.Random) -> TensorLayout:
    shape = [rng.randint(1, 7) for _ in range(rng.randint(0, 3))]
    split = []
    for dim, extent in enumerate(shape):
        if rng.random() < 0.7:
            parts, left = [], extent
            while left:
                size = rng.randint(1, left)
                count = rng.randint(1, left // size)
                parts.append((size, count))  # adjacent runs of one size are left unmerged
                left -= size * count
            split.append((dim, Runs.of(parts)))
    cells = 1
    for _dim, parts in split:
        cells *= parts.length
    holders, left = [], cells
    while left:
        count = rng.randint(1, left)
        holders.append((rng.randint(0, 5), count))
        left -= count
    return TensorLayout("float32", tuple(shape), tuple(split), Runs.of(holders))

