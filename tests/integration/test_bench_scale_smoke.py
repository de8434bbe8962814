"""The scaling benchmark still runs (``make bench-scale`` runs the real sizes): every
axis at its smallest, the tables and files it promises, finite ratios, and a
simulated many-rank manifest that ckptvault itself parses back."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from support.common import REPO

if str(REPO) not in sys.path:  # bench/ is a package at the repository root, not installed
    sys.path.insert(0, str(REPO))

from bench import scale
from bench.scale_memory import measure_memory
from bench.scale_ranks import (
    MemoryGeneration,
    build_manifest,
    encode,
    global_plan,
    gpt_model,
    lay_out,
    local_plans,
    manifest_documents,
    measure_ranks,
)
from bench.scale_tensors import RESTORES, SAVES

from ckptvault.format.layout import GenerationName
from ckptvault.format.manifest import parse_manifest
from ckptvault.state.capture import capture_state
from ckptvault.storage.base import GenerationRef
from ckptvault.trust.indexes import load_indexes


@pytest.mark.heavy
@pytest.mark.extended  # a benchmark's smoke run: make test-extended
def test_every_axis_runs_and_reports(tmp_path: Path):
    out = tmp_path / "out"
    text = scale.main(
        ["--counts", "10", "--reps", "1", "--no-tmpfs", "--memory-count", "0",
         "--ranks", "1", "2", "--layers", "1", "--width", "64",
         "--generations", "2", "--dir", str(tmp_path / "work"), "--out", str(out)]
    )  # fmt: skip
    for row in (*SAVES, *RESTORES, "ckptvault save (first)"):
        assert f"| {row} | flat |" in text and f"| {row} | module |" in text
    assert "| **ckptvault save / torch.save+fsync** | flat |" in text
    assert "## Simulated ranks" in text and "## Generations" in text
    assert "grows with ranks (1-2 ranks): slope" in text and "| generations()" in text
    assert (out / "scale.md").read_text() == text
    results = json.loads((out / "scale.json").read_text())
    for point in results["tensors"]:
        seconds = point["seconds"]
        for layout in ("flat", "module"):
            for ours, theirs in ((SAVES[3], SAVES[0]), (RESTORES[3], RESTORES[0])):
                ratio = min(seconds[f"disk|{layout}|{ours}"]) / min(
                    seconds[f"disk|{layout}|{theirs}"]
                )
                assert math.isfinite(ratio) and ratio > 0
    assert [p["ranks"] for p in results["ranks"]] == [1, 2]
    assert all(size > 0 for p in results["ranks"] for size in p["documents"].values())
    listed = results["generations"]
    assert set(listed) == {"2"} and all(
        math.isfinite(v) and v >= 0 for figures in listed.values() for v in figures.values()
    )


def test_the_memory_measurement_runs(tmp_path: Path):
    measured = measure_memory(10, tmp_path, "ckptvault")
    assert measured["data_bytes"] == 10 * 256 * 4
    assert measured["save_growth"] >= 0 and measured["restore_growth"] >= 0


def test_the_simulated_manifest_is_one_ckptvault_reads():
    """The rank axis measures a real format-3 generation: the root parses, rank 0
    reads only its own index beside it, and all indexes together hold every rank's
    shard of every parameter, laid out in the ranks' files."""
    model = gpt_model(layers=1, width=64, vocab=96)
    point = measure_ranks(3, model)
    params = len(capture_state({"model": model}).tensors)
    assert point.parameters == params == 15 and point.items == 3 * params
    assert point.writable and point.read_bytes > 0 and point.parse_s > 0
    assert point.indexes == 3 and sorted(point.documents) == ["manifest.json", "r00000-index.json"]

    plans = local_plans(capture_state({"model": model}).tensors, 3)
    assert [len(p.items) for p in plans] == [params] * 3
    final, metadata = global_plan(plans)
    locations, records = lay_out(final, 3)
    tree = capture_state({"model": model}).tree
    generation = MemoryGeneration()
    manifest, root, writable = encode(
        build_manifest(tree, metadata, locations, records, 3), generation
    )
    documents = manifest_documents(manifest, root, generation, 3, rank=1)
    assert writable and sorted(documents) == ["manifest.json", "r00001-index.json"]
    parsed = parse_manifest(root, "smoke")
    assert parsed.writer["world_size"] == 3 and parsed.format_version == 3
    ref = GenerationRef(GenerationName(parsed.step, parsed.generation_id), "memory")
    own = load_indexes(generation, ref, parsed, ["r00001-index.json"])  # type: ignore[arg-type]
    assert {c["file"][:6] for t in own.dcp["tensors"].values() for c in t["chunks"]} == {"r00001"}
    tensors = load_indexes(generation, ref, parsed).dcp["tensors"]  # type: ignore[arg-type]
    assert len(tensors) == params and all(len(t["chunks"]) == 3 for t in tensors.values())
    assert {c["file"][:6] for t in tensors.values() for c in t["chunks"]} == {
        "r00000",
        "r00001",
        "r00002",
    }
