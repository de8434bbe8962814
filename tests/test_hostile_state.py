"""Hostile state: planted generations whose *contents* target restore's later stages
(decoding the state tree, planning, applying), the allocator, export and the CLI.

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
import random
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
from safetensors.torch import load_file

import ckptvault as cv
from ckptvault.cli import main
from ckptvault.errors import (
    CheckpointError,
    ContractMismatch,
    FormatError,
    IntegrityError,
    StateMismatchError,
)
from ckptvault.format.bounded_json import loads_bounded
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.layout import generation_dirname
from ckptvault.format.records import FileRecord
from ckptvault.ops import export as export_module
from ckptvault.ops.export import export_weights
from ckptvault.state.apply import plan_restore
from ckptvault.state.contract import compare_contracts
from ckptvault.storage.posix import PosixStore
from ckptvault.storage.records import DELETION_MARK
from ckptvault.trust import checks
from ckptvault.trust.context import TrustContext
from ckptvault.trust.digests import derived_file_digest, verify_stream
from ckptvault.trust.keystore import LocalKeyStore
from ckptvault.trust.signing import generate_keypair
from conftest import (
    assert_same_tensors,
    make_training_state,
    model_snapshot,
    run_cli,
    train_steps,
    writable,
)
from test_hostile_inputs import RAW_ERRORS, forge_manifest

ESC = "\x1b"

# -- planting, as an attacker without the signing key -------------------------------


@pytest.fixture
def two_steps(store: Path) -> tuple[dict[int, Path], dict[int, dict]]:
    """Steps 1 and 2 of an unsigned run; the attacks target step 2."""
    state = make_training_state()
    paths, weights = {}, {}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        for step in (1, 2):
            train_steps(state, 1)
            weights[step] = model_snapshot(state["model"])
            paths[step] = Path(mgr.save(step, state).result().path)
    return paths, weights


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
    "torch-generator-device-object": "not a device name",
    "void-numpy-scalar": "refusing numpy dtype '|V1'",
}


@pytest.mark.parametrize("attack", sorted(MALFORMED_TREES))
def test_malformed_state_tree_is_skipped(store, two_steps, attack):
    paths, weights = two_steps
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


# -- 7. planning refuses what applying would get wrong ------------------------------


def add_scheduler_attributes(state: dict) -> None:
    pairs = state["scheduler"]["$stateful"]["state"]["$dict"]
    pairs.append(["step", 0])  # would shadow the step() method
    pairs.append(["optimizer", {"param_groups": []}])  # would detach it from the optimizer


def test_scheduler_state_cannot_inject_attributes(store, two_steps):
    paths, _ = two_steps
    forge_manifest(paths[2], tree(add_scheduler_attributes))
    assert_refused_untouched(store, "not in the live torch.optim.lr_scheduler.StepLR")
    # strict=False loads what matches, and still never the foreign keys.
    fresh = make_training_state(seed=9)
    outcome = restore_into(store, fresh, strict=False)
    assert isinstance(outcome, cv.RestoreInfo), outcome
    if outcome.step == 2:
        assert any("['step']" in entry for entry in outcome.unexpected)
        assert fresh["scheduler"].last_epoch == 2
    assert_scheduler_intact(fresh)


def test_scheduler_state_layout_is_checked_all_the_way_down(store, two_steps):
    paths, _ = two_steps

    def base_lrs_become_a_dict(state: dict) -> None:
        set_pair(state["scheduler"]["$stateful"]["state"]["$dict"], "base_lrs", {"__class__": 1})

    forge_manifest(paths[2], tree(base_lrs_become_a_dict))
    assert_refused_untouched(store, "base_lrs")


class Counter:
    """A user's stateful object whose load_state_dict is a ``__dict__.update``."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


class Fragile(Counter):
    """Refuses to load when told to: an object's own code failing during apply."""

    refuse = False

    def load_state_dict(self, state: dict) -> None:
        if self.refuse:
            raise ValueError("cannot take that")
        super().load_state_dict(state)


def test_generic_stateful_state_cannot_inject_attributes(store):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        counter = Counter()
        for step in (1, 2):
            counter.count = step
            mgr.save(step, {"counter": counter})
    step_2 = next(store.glob("step-000000000002.*"))
    forge_manifest(
        step_2,
        tree(lambda s: s["counter"]["$stateful"]["state"].__setitem__("state_dict", 1)),
    )
    fresh = Counter()
    outcome = restore_into(store, {"counter": fresh})
    if isinstance(outcome, cv.RestoreInfo):
        assert outcome.step == 1 and fresh.count == 1
    else:
        assert isinstance(outcome, StateMismatchError) and "state_dict" in str(outcome)
        assert fresh.count == 0
    assert "state_dict" not in vars(fresh) and fresh.state_dict() == {"count": fresh.count}


def test_optimizer_groups_that_are_not_groups(store, two_steps):
    paths, _ = two_steps

    def groups_are_numbers(state: dict) -> None:
        set_pair(state["optimizer"]["$stateful"]["state"]["$dict"], "param_groups", [1, 2])

    forge_manifest(paths[2], tree(groups_are_numbers))
    assert_refused_untouched(store, "param_groups")


def test_module_entry_that_is_not_a_tensor(store, two_steps):
    paths, _ = two_steps
    forge_manifest(
        paths[2], tree(lambda s: set_pair(s["model"]["$stateful"]["state"]["$dict"], "fc2.bias", 5))
    )
    assert_refused_untouched(store, "fc2.bias")


def test_malformed_rng_states_are_tried_before_anything_is_set(store, two_steps):
    paths, _ = two_steps

    def short_python_state(state: dict) -> None:
        pairs = state["rng"]["$rng"]["$dict"]
        python = next(value for key, value in pairs if key == "python")["$tuple"]
        python[1] = {"$tuple": [1, 2, 3]}  # decodes fine; random.setstate refuses it

    forge_manifest(paths[2], tree(short_python_state))
    random.seed(1234)
    expected = random.getstate()
    outcome = assert_refused_untouched(store, "python")
    if isinstance(outcome, CheckpointError):  # refused: the global RNGs were not touched
        assert random.getstate() == expected


def test_malformed_numpy_generator_state(store, two_steps):
    paths, _ = two_steps
    forge_manifest(
        paths[2],
        tree(
            lambda s: s.__setitem__(
                "sampler_rng", {"$np_generator": {"bit_generator": "PCG64", "state": "junk"}}
            )
        ),
    )
    assert_refused_untouched(store, "sampler_rng")


def test_malformed_torch_generator_state(store):
    state = {"gen": torch.Generator().manual_seed(3), "buf": torch.ones(16, dtype=torch.uint8)}
    state["meta"] = {"n": 1}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        for step in (1, 2):
            state["meta"]["n"] = step
            mgr.save(step, state)
    step_2 = next(store.glob("step-000000000002.*"))

    def short_state(document: dict) -> None:
        # A 1-d uint8 tensor (so it decodes), of the wrong size for a generator state.
        document["state"]["gen"]["$torch_generator"]["state"] = {"$tensor": "buf"}

    forge_manifest(step_2, short_state)
    fresh = {
        "gen": torch.Generator().manual_seed(99),
        "buf": torch.zeros(16, dtype=torch.uint8),
        "meta": {"n": 0},
    }
    live = fresh["gen"].get_state().clone()
    outcome = restore_into(store, fresh)
    if isinstance(outcome, cv.RestoreInfo):
        assert outcome.step == 1 and fresh["meta"]["n"] == 1
    else:
        assert isinstance(outcome, StateMismatchError) and "state['gen']" in str(outcome)
        assert torch.equal(fresh["gen"].get_state(), live) and fresh["meta"]["n"] == 0
        assert not fresh["buf"].any()


@pytest.mark.parametrize("fields", [[[1]], "x", {"1": {"$dict": [[[1], 2]]}}])
def test_hostile_contract_shapes(store, fields):
    state = make_training_state()
    with cv.CheckpointManager(store, run_id="r", contract={"dataset": "ds"}) as mgr:
        for step in (1, 2):
            train_steps(state, 1)
            mgr.save(step, state)
    step_2 = next(store.glob("step-000000000002.*"))
    forge_manifest(step_2, lambda document: document["contract"].__setitem__("fields", fields))
    outcome = assert_refused_untouched(store, contract={"dataset": "ds"})
    assert isinstance(outcome, (cv.RestoreInfo, FormatError, ContractMismatch)), outcome


def test_compare_contracts_only_raises_typed_errors():
    for stored in ({"fields": [[1]]}, {"fields": "x"}, [], {"fields": {1: 2}}):
        with pytest.raises(FormatError, match="contract is malformed"):
            compare_contracts(stored, {"a": 1}, "generation g")  # type: ignore[arg-type]
    with pytest.raises(ContractMismatch, match=r"a: \[\[1\]\] → 1"):
        compare_contracts({"fields": {"a": [[1]]}}, {"a": 1}, "generation g")
    compare_contracts({"fields": {"a": 1}}, {"a": 1}, "generation g")


def test_apply_failures_are_typed_and_name_the_entry(store):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"obj": Fragile(), "meta": {"n": 1}})
    meta = {"n": 0}
    fragile = Fragile()
    fragile.refuse = True
    with (
        cv.CheckpointManager(store, run_id="r") as mgr,
        pytest.raises(StateMismatchError, match=r"state\['obj'\].*ValueError") as caught,
    ):
        mgr.restore({"obj": fragile, "meta": meta})
    assert caught.value.mismatched == ["state['obj']"]
    # Loads into objects run before plain values are replaced, RNG last.
    assert meta == {"n": 0}


def test_plan_apply_order_loads_then_contents_then_rng(store):
    state = make_training_state()
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, state)
        loaded = mgr.restore(make_training_state(seed=1))
    assert loaded is not None
    from ckptvault.io.load import load_verified
    from ckptvault.trust.checks import TrustPolicy

    opened = PosixStore(store)
    ref = opened.list_generations()[0]
    saved = load_verified(opened, ref, TrustPolicy(), None, 1).saved
    plan = plan_restore(make_training_state(seed=2), saved)
    wheres = [a.where for a in (*plan.actions, *plan.replacements, *plan.rng_actions)]
    assert wheres.index("state['model']") < wheres.index("state['meta']")
    assert wheres[-2:] == ["state['rng']", "state['sampler_rng']"]


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


# -- 9. export reads through the same rules as restore -------------------------------


def test_export_refuses_planted_plaintext_in_an_encrypted_run(tmp_path):
    store, keys = tmp_path / "store", tmp_path / "keys"
    model = torch.nn.Linear(4, 3)
    with cv.CheckpointManager(store, run_id="r", keystore=keys) as mgr:
        mgr.save(10, {"model": model})
    evil = torch.nn.Linear(4, 3)
    with torch.no_grad():
        evil.weight.fill_(1337.0)
    elsewhere = tmp_path / "elsewhere"
    with cv.CheckpointManager(elsewhere, run_id="r") as mgr:
        planted = Path(mgr.save(10, {"model": evil}).result().path)
    shutil.copytree(planted, store / planted.name)  # the newest generation of step 10
    out = tmp_path / "model.safetensors"
    export_weights(store, 10, out, keystore=LocalKeyStore(keys))
    assert torch.equal(load_file(out)["weight"], model.weight.detach())
    remove_generation(next(p for p in store.glob("step-*") if p.name != planted.name))
    result = run_cli(
        "export", str(store), "--step", "10", "--out", str(out), "--keystore", str(keys)
    )
    assert result.returncode == 2 and "not-encrypted" in result.stderr
    assert torch.equal(load_file(out)["weight"], model.weight.detach())


def test_export_learns_the_run_id_cheaply(store, tmp_path, monkeypatch):
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    with cv.CheckpointManager(store, run_id="r", signing_key=tmp_path / "k.pem") as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": torch.nn.Linear(2, 2)})
    good = next(store.glob("step-000000000002.*"))
    for index in range(3):  # unsigned, newer, of the step asked for and of another
        plant_copy(good, 2, f"20991231T23595900000{index}Z-deadbeef")
        plant_copy(good, 3, f"20991231T23595900000{index}Z-deadbeef")
    parsed: list[int] = []
    original = checks.parse_manifest

    def counting(data: bytes, where: str) -> Any:
        parsed.append(len(data))
        return original(data, where)

    monkeypatch.setattr(checks, "parse_manifest", counting)
    trust = TrustContext.configure(trusted_keys=[tmp_path / "k.pub"])
    opened = PosixStore(store)
    assert export_module._only_run(opened, 2, trust) == "r"
    assert len(parsed) == 1  # the genuine one: the planted ones failed their signature
    parsed.clear()
    assert export_module._only_run(opened, 2, TrustContext()) == "r"
    assert len(parsed) <= export_module.MAX_RUN_PROBES
    out = tmp_path / "model.safetensors"
    result = run_cli(
        "export",
        str(store),
        "--step",
        "2",
        "--out",
        str(out),
        "--trusted-key",
        str(tmp_path / "k.pub"),
    )
    assert result.returncode == 0, result.stderr


def test_export_refuses_runs_that_disagree(store, tmp_path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(2, {"model": torch.nn.Linear(2, 2)})
    good = next(store.glob("step-000000000002.*"))
    planted = plant_copy(good, 2, "20991231T235959000000Z-deadbeef")
    forge_manifest(planted, lambda document: document.__setitem__("run_id", "evil"))
    with pytest.raises(cv.errors.UsageError, match="evil, r"):
        export_weights(store, 2, tmp_path / "x.safetensors")


# -- 10. what the CLI prints ----------------------------------------------------------

HOSTILE = "r[/bold][link=https://evil.example/]x[/link]\x1b]0;pwned\x07\x1b[2J\x9b31m\u202e"


def assert_terminal_safe(text: str) -> None:
    for char in (ESC, "\x07", "\x9b", "\u202e"):
        assert char not in text, repr(text[:300])


def test_inspect_prints_store_strings_inert(store, two_steps):
    paths, _ = two_steps
    forge_manifest(paths[2], lambda document: document.__setitem__("run_id", HOSTILE))
    human = run_cli("inspect", str(store), "--step", "2")
    assert human.returncode == 0, human.stderr
    assert_terminal_safe(human.stdout)
    assert "r[/bold][link=https://evil.example/]x[/link]\\x1b]0;pwned\\x07" in human.stdout
    as_json = run_cli("inspect", str(store), "--step", "2", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert_terminal_safe(as_json.stdout)
    assert json.loads(as_json.stdout)["generation"]["run_id"] == HOSTILE  # exact JSON


def test_inspect_markup_in_names_does_not_crash(store, two_steps, capsys):
    paths, _ = two_steps
    forge_manifest(paths[2], lambda document: document.__setitem__("run_id", "r[/bold]"))
    assert main(["inspect", str(store), "--step", "2"]) == 0
    assert "run r[/bold]" in capsys.readouterr().out


def test_verify_prints_planted_key_ids_inert(store, two_steps, tmp_path):
    paths, _ = two_steps
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    signature = {
        "algorithm": "ed25519",
        "format": "ckptvault-signature/1",
        "key_id": HOSTILE,
        "signature": "",
    }
    paths[2].chmod(0o755)
    (paths[2] / "manifest.sig").write_bytes(dumps_canonical(signature))
    human = run_cli("verify", str(store), "--step", "2", "--trusted-key", str(tmp_path / "k.pub"))
    assert human.returncode == 1 and "signature-untrusted" in human.stdout
    assert_terminal_safe(human.stdout + human.stderr)
    as_json = run_cli(
        "verify", str(store), "--step", "2", "--json", "--trusted-key", str(tmp_path / "k.pub")
    )
    assert as_json.returncode == 1
    assert_terminal_safe(as_json.stdout)
    (report,) = json.loads(as_json.stdout)
    assert any(HOSTILE in p["detail"] for p in report["problems"])  # exact, not lost
    # An error line (and the warnings before it) quote the same key id: inert too.
    failed = run_cli(
        "export",
        str(store),
        "--step",
        "2",
        "--out",
        str(tmp_path / "x"),
        "--trusted-key",
        str(tmp_path / "k.pub"),
        "--run-id",
        "r",
    )
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert_terminal_safe(failed.stderr)
    assert failed.stderr.strip().splitlines()[-1].startswith("ckptvault: error:")


def test_ls_prints_planted_marks_inert(store, two_steps):
    paths, _ = two_steps
    PosixStore(store).put_record(
        DELETION_MARK, paths[2].name, {"marked_at": "2020-01-01T00:00:00Z", "reason": HOSTILE}
    )
    listed = run_cli("ls", str(store), "--all")
    assert listed.returncode == 0, listed.stderr
    assert_terminal_safe(listed.stdout)
    as_json = run_cli("ls", str(store), "--all", "--json")
    assert_terminal_safe(as_json.stdout)
    marked = [entry for entry in json.loads(as_json.stdout) if entry.get("marked")]
    assert marked and marked[0]["marked"]["reason"] == HOSTILE


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
