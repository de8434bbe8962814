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
import shutil
import sys
import tracemalloc
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from blake3 import blake3

import ckptvault as cv
from ckptvault.errors import (
    CheckpointError,
    FormatError,
    IntegrityError,
)
from ckptvault.format.bounded_json import loads_bounded
from ckptvault.format.layout import generation_dirname
from ckptvault.format.records import FileRecord
from ckptvault.trust.digests import derived_file_digest, verify_stream
from conftest import (
    assert_same_tensors,
    make_training_state,
    model_snapshot,
    run_cli,
    writable,
)
from test_hostile_inputs import RAW_ERRORS, forge_manifest, save_two_steps

ESC = "\x1b"

# -- planting, as an attacker without the signing key -------------------------------


@pytest.fixture
def two_steps(store: Path) -> tuple[dict[int, Path], dict[int, dict]]:
    """Steps 1 and 2 of an unsigned run (format 3); the attacks target step 2."""
    return save_two_steps(store)


def plant_copy(source: Path, step: int, generation_id: str) -> Path:
    """A copy of generation ``source`` planted as (``step``, ``generation_id``),
    its manifest re-sealed, its signature (if any) dropped."""
    target = source.parent / generation_dirname(step, generation_id)
    shutil.copytree(source, target)
    target.chmod(0o755)
    for file in target.iterdir():
        writable(file)
    (target / "manifest.sig").unlink(missing_ok=True)

    def rename(document: dict) -> None:
        document.update(step=step, generation_id=generation_id)

    forge_manifest(target, rename)
    return target


def remove_generation(path: Path) -> None:
    """Published generations are read-only; the attacker removes one anyway."""
    for entry in [path, *path.iterdir()]:
        entry.chmod(0o755)
    shutil.rmtree(path)


def set_pair(pairs: list[list[Any]], key: Any, value: Any) -> None:
    """Set ``key`` in a ``$dict`` payload (a list of [key, value] pairs)."""
    for pair in pairs:
        if pair[0] == key:
            pair[1] = value
            return
    pairs.append([key, value])


def meta_x(state: dict, value: Any) -> None:
    """Plant ``value`` as ``state["meta"]["x"]`` (meta's keys are unsorted: a $dict)."""
    set_pair(state["meta"]["$dict"], "x", value)


def tree(change: Callable[[dict], None]) -> Callable[[dict], None]:
    """A manifest change that edits the saved state tree."""
    return lambda document: change(document["state"])


def restore_into(
    store: Path, state: dict, contract: dict | None = None, **options: Any
) -> cv.RestoreInfo | CheckpointError:
    """Restore, returning the info or the typed error; a raw error fails the test."""
    try:
        with cv.CheckpointManager(store, run_id="r", contract=contract) as mgr:
            info = mgr.restore(state, **options)
            assert info is not None
            return info
    except CheckpointError as exc:
        return exc
    except RAW_ERRORS as exc:  # pragma: no cover - the failure this file exists for
        pytest.fail(f"restore let a raw {type(exc).__name__} escape: {exc}")


def restore_skipping(store: Path, code: str, fragment: str = "", **options: Any) -> dict:
    """Restore must skip step 2 with ``code`` and apply step 1; returns the state."""
    fresh = make_training_state(seed=9)
    outcome = restore_into(store, fresh, **options)
    assert isinstance(outcome, cv.RestoreInfo), outcome
    assert outcome.step == 1
    assert [(s.step, s.reason.split(":")[0]) for s in outcome.skipped] == [(2, code)], (
        outcome.skipped
    )
    assert fragment in outcome.skipped[0].reason
    return fresh


def assert_refused_untouched(
    store: Path, fragment: str = "", **options: Any
) -> cv.RestoreInfo | CheckpointError:
    """Step 2 must not be applied: either it is skipped (and step 1 is applied), or
    restore refuses with a typed error and the caller's state is exactly as it was.
    (Planning runs once a generation verified; whether a planning refusal skips to
    the next generation or ends the restore is the restorer's choice.)"""
    fresh = make_training_state(seed=9)
    before = model_snapshot(fresh["model"])
    meta_before = json.dumps(fresh["meta"])
    outcome = restore_into(store, fresh, **options)
    if isinstance(outcome, cv.RestoreInfo):
        assert outcome.step == 1 and [s.step for s in outcome.skipped] == [2]
        assert fragment in outcome.skipped[0].reason
    else:
        assert fragment in str(outcome)
        assert_same_tensors(model_snapshot(fresh["model"]), before)
        assert json.dumps(fresh["meta"]) == meta_before
    assert_scheduler_intact(fresh)
    return outcome


def assert_scheduler_intact(state: dict) -> None:
    scheduler = state["scheduler"]
    assert "step" not in vars(scheduler) and scheduler.optimizer is state["optimizer"]
    with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()"
        warnings.simplefilter("ignore")
        scheduler.step()  # still the method, still driving the live optimizer


# -- 7. a malformed state tree is a malformed generation ----------------------------

MALFORMED_TREES: dict[str, Callable[[dict], None]] = {
    "rng-not-a-dict": lambda s: s.__setitem__("rng", {"$rng": [1, 2]}),
    "numpy-generator-not-a-dict": lambda s: s.__setitem__("sampler_rng", {"$np_generator": [1]}),
    "optimizer-state-a-list": lambda s: s["optimizer"]["$stateful"].__setitem__("state", [1]),
    "module-state-a-list": lambda s: s["model"]["$stateful"].__setitem__("state", [[1]]),
    "module-metadata-a-list": lambda s: s["model"]["$stateful"].__setitem__("module_metadata", [1]),
    "module-metadata-assigns": lambda s: s["model"]["$stateful"].__setitem__(
        "module_metadata", {"": {"assign_to_params_buffers": True, "version": 1}}
    ),
    "stateful-unknown-kind": lambda s: s["optimizer"]["$stateful"].__setitem__("kind", "evil"),
    "torch-generator-device-object": lambda s: s.__setitem__(
        "tg", {"$torch_generator": {"device": {"a": 1}, "state": 1}}
    ),
    "void-numpy-scalar": lambda s: meta_x(s, {"$np_scalar": {"dtype": "|V1", "value": 6 * 2**30}}),
    "int-scalar-from-float": lambda s: meta_x(s, {"$np_scalar": {"dtype": "<i8", "value": 1.5}}),
    "ndarray-bytes-disagree": lambda s: meta_x(
        s, {"$ndarray": {"dtype": "<f4", "shape": [10**9], "data": ""}}
    ),
    "ndarray-structured-dtype": lambda s: meta_x(
        s, {"$ndarray": {"dtype": "i4,i4", "shape": [0], "data": ""}}
    ),
    "bigint-not-hex": lambda s: meta_x(s, {"$bigint": " 0x1_0"}),
    "dict-unhashable-key": lambda s: meta_x(s, {"$dict": [[[1], 2]]}),
    "dict-duplicate-key": lambda s: meta_x(s, {"$dict": [[1, 2], [1, 3]]}),
    "dict-not-pairs": lambda s: meta_x(s, {"$dict": [[1, 2, 3]]}),
    "float-a-list": lambda s: meta_x(s, {"$float": [1]}),
    "tensor-reference-a-list": lambda s: meta_x(s, {"$tensor": [1]}),
    "tensor-reference-to-nothing": lambda s: meta_x(s, {"$tensor": "model/missing"}),
    "device-odd": lambda s: meta_x(s, {"$torch_device": "cuda:0:1"}),
    "device-object": lambda s: meta_x(s, {"$torch_device": {"a": 1}}),
    "size-of-strings": lambda s: meta_x(s, {"$torch_size": ["1"]}),
    "dtype-not-a-dtype": lambda s: meta_x(s, {"$torch_dtype": "tensor"}),
}


# Why each is refused: the payload check that catches it, not a later accident.
WHY_REFUSED = {
    "bigint-not-hex": "lowercase hex",
    "device-object": "not a device name",
    "device-odd": "not a device name",
    "dict-duplicate-key": "twice",
    "dict-not-pairs": "[key, value] pairs",
    "dict-unhashable-key": "unhashable",
    "dtype-not-a-dtype": "unknown torch dtype",
    "float-a-list": "$float must be one of",
    "int-scalar-from-float": "must be of type int",
    "module-metadata-a-list": "module metadata must be a dict",
    "module-metadata-assigns": "assign_to_params_buffers",
    "module-state-a-list": "module state must be a dict",
    "ndarray-bytes-disagree": "does not match its 0 data bytes",
    "ndarray-structured-dtype": "not a numpy dtype",
    "numpy-generator-not-a-dict": "bit generator's state dict",
    "optimizer-state-a-list": "optimizer state must be a dict",
    "rng-not-a-dict": "$rng must hold",
    "size-of-strings": "$torch_size must be",
    "stateful-unknown-kind": "unknown stateful kind",
    "tensor-reference-a-list": "$tensor must name",
    "tensor-reference-to-nothing": "is not in the checkpoint",
    "torch-generator-device-object": "not a device name",
    "void-numpy-scalar": "refusing numpy dtype '|V1'",
}


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
