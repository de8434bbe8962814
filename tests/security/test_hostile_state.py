"""Hostile state: planted generations whose *contents* target restore's later stages
(decoding the state tree, planning, applying), the allocator, export and the CLI.
Planning is in ``test_hostile_planning.py``, export and the CLI's output in
``test_hostile_output.py``; the state tree is decoded alike in every format.

As in ``test_hostile_inputs``, every attack runs against a real store on disk, as
someone who can write the store but holds no signing key, and re-seals what they
change. The secure outcome: the generation is skipped with a reason code and the
next one is tried, or restore refuses with a typed error; the caller's state is
untouched unless a generation is applied completely (and never gains attributes);
nothing raw escapes; every CLI command prints one line on error and never a raw
control character.
"""

from __future__ import annotations

import io
import json
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from blake3 import blake3

import ckptvault as cv
from ckptvault.errors import (
    FormatError,
    IntegrityError,
)
from ckptvault.format.bounded_json import loads_bounded
from ckptvault.format.records import FileRecord
from ckptvault.trust.digests import derived_file_digest, verify_stream
from support.common import (
    assert_same_tensors,
    make_training_state,
    model_snapshot,
    run_cli,
    writable,
)
from support.hostile_forging import forge_manifest
from support.hostile_inputs import save_two_steps
from support.hostile_state import (
    MALFORMED_TREES,
    WHY_REFUSED,
    assert_scheduler_intact,
    meta_x,
    restore_into,
    restore_skipping,
    tree,
)

# -- planting, as an attacker without the signing key -------------------------------


@pytest.fixture
def two_steps(store: Path) -> tuple[dict[int, Path], dict[int, dict]]:
    """Steps 1 and 2 of an unsigned run (format 3); the attacks target step 2."""
    return save_two_steps(store)




















# -- 7. a malformed state tree is a malformed generation ----------------------------





@pytest.mark.parametrize("version", [3, 2], ids=["format-3", "format-2"])
@pytest.mark.parametrize("attack", sorted(MALFORMED_TREES))
def test_malformed_state_tree_is_skipped(store, attack, version):
    """In a format-3 root, and in a planted format-2 manifest (the reader still
    accepts that format): the state tree is decoded the same way."""
    paths, weights = save_two_steps(store, version)
    forge_manifest(paths[2], tree(MALFORMED_TREES[attack]))
    fresh = restore_skipping(store, "manifest-invalid", WHY_REFUSED[attack])
    assert_same_tensors(model_snapshot(fresh["model"]), weights[1])
    assert_scheduler_intact(fresh)


@pytest.mark.parametrize("name", ["onnx", "_dynamo", "_inductor", "_export"])
def test_dtype_names_never_import_anything(store, two_steps, name):
    paths, _ = two_steps
    restore_into(store, make_training_state(seed=9))  # what restore imports anyway
    forge_manifest(paths[2], tree(lambda s: meta_x(s, {"$torch_dtype": name})))
    before = set(sys.modules)
    restore_skipping(store, "manifest-invalid", "unknown torch dtype")
    assert f"torch.{name}" not in set(sys.modules) - before


def test_dtypes_and_devices_still_round_trip(store):
    values = {
        "dtypes": [torch.float32, torch.bfloat16, torch.int4, torch.complex128, torch.qint8],
        "devices": [torch.device("cpu"), torch.device("cuda", 1), torch.device("meta")],
        "size": torch.Size([2, 3]),
        "scalars": [np.int8(-3), np.uint64(2**64 - 1), np.float16(0.5), np.bool_(True)],
        "array": np.arange(6, dtype=">i2").reshape(2, 3),
        "strings": np.array(["a", "bc"]),
        "times": np.array(["2024-01-01"], dtype="datetime64[D]"),
        "big": -(10**5000),
        "pairs": {(1, "a"): 2, 3: 4},
    }
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"meta": values})
    fresh: dict[str, Any] = {"meta": {}}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.restore(fresh)
    restored = fresh["meta"]
    assert restored["dtypes"] == values["dtypes"] and restored["devices"] == values["devices"]
    assert restored["size"] == values["size"] and restored["big"] == values["big"]
    for saved, back in zip(values["scalars"], restored["scalars"], strict=True):
        assert type(back) is type(saved) and back == saved
    for key in ("array", "strings", "times"):
        assert restored[key].dtype == values[key].dtype
        assert np.array_equal(restored[key], values[key])
    assert restored["pairs"] == values["pairs"]


# -- 8. sparse files and allocation failures -----------------------------------------


def test_allocation_failure_skips_the_generation(store, two_steps, monkeypatch):
    """An allocator that cannot serve the declared tensors (what a terabyte-sized
    claim does on a real machine) rejects that generation with a reason. Both
    allocating paths: DCP's (``dcp_io``) and the planner-free one (``whole_read``)."""
    from ckptvault.io import dcp_io, whole_read

    calls = {"n": 0}

    class OutOfMemory:
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

        def empty(self, *args: Any, **kwargs: Any) -> torch.Tensor:
            calls["n"] += 1
            if calls["n"] == 1:  # the first tensor of the newest generation
                raise RuntimeError(
                    "[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: not enough memory"
                )
            return torch.empty(*args, **kwargs)

    allocator = OutOfMemory()
    monkeypatch.setattr(dcp_io, "torch", allocator)
    monkeypatch.setattr(whole_read, "torch", allocator)
    _, weights = two_steps
    fresh = restore_skipping(store, "unreadable", "cannot allocate")
    assert_same_tensors(model_snapshot(fresh["model"]), weights[1])


def test_verify_buffers_are_no_larger_than_the_file():
    data = b"0123456789"
    chunks = (blake3(data).hexdigest(),)
    record = FileRecord(len(data), derived_file_digest(len(data), chunks), chunks)
    tracemalloc.start()
    try:
        verify_stream(io.BytesIO(data), record, 256 * 1024 * 1024, "f")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1024 * 1024
    with pytest.raises(IntegrityError, match="longer"):
        verify_stream(io.BytesIO(data + b"x"), record, 256 * 1024 * 1024, "f")
    empty = FileRecord(0, derived_file_digest(0, ()), ())
    verify_stream(io.BytesIO(b""), empty, 1024, "f")
    with pytest.raises(IntegrityError):
        verify_stream(io.BytesIO(b"x"), empty, 1024, "f")


# -- lone surrogates are not text ---------------------------------------------------


def test_lone_surrogate_escapes_are_format_errors():
    for document in (b'{"a":"\\ud800"}', b'{"\\udfff":1}', b'[["x\\uDC00y"]]'):
        with pytest.raises(FormatError, match="lone surrogate"):
            loads_bounded(document, "doc", max_depth=8)
    assert loads_bounded(b'{"a":"\\ud83d\\ude00"}', "doc", max_depth=8) == {"a": "\U0001f600"}
    assert loads_bounded(b'{"a":"\\\\ud800"}', "doc", max_depth=8) == {"a": "\\ud800"}


def test_lone_surrogate_in_a_manifest_is_skipped(store, two_steps):
    paths, _ = two_steps
    manifest = paths[2] / "manifest.json"
    forge_manifest(paths[2])
    data = manifest.read_bytes().replace(b'"created_at":"', b'"created_at":"\\ud800', 1)
    writable(manifest).write_bytes(data)
    restore_skipping(store, "manifest-invalid", "lone surrogate")
    result = run_cli("verify", str(store), "--all", "--json")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert not {entry["step"]: entry for entry in json.loads(result.stdout)}[2]["ok"]
