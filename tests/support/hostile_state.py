"""What the hostile-state tests share: planting copies, restoring into live objects, checking nothing changed."""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ckptvault as cv
from ckptvault.errors import (
    CheckpointError,
)
from ckptvault.format.layout import generation_dirname
from support.common import (
    assert_same_tensors,
    make_training_state,
    model_snapshot,
    writable,
)
from support.hostile_forging import forge_manifest
from support.hostile_inputs import RAW_ERRORS

ESC = "\x1b"


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

