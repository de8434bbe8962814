"""What a checkpoint holds: every supported kind of state saves and restores in place."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptvault as cv
from ckptvault.errors import UnsupportedValueError, UsageError
from support.common import assert_same_tensors, make_training_state, model_snapshot, train_steps


def test_full_training_state_roundtrip_in_place(store: Path):
    state = make_training_state()
    train_steps(state, 5)
    expected_model = model_snapshot(state["model"])
    expected_opt = {
        pid: {name: value.clone() for name, value in entry.items()}
        for pid, entry in state["optimizer"].state_dict()["state"].items()
    }
    expected_lr = state["scheduler"].get_last_lr()
    meta = state["meta"]
    history = meta["history"]
    expected_meta = {"tokens_seen": meta["tokens_seen"], "history": list(history)}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(5, state)
        train_steps(state, 3)  # move everything on
        info = mgr.restore(state)
    assert info is not None and info.step == 5 and info.skipped == []
    assert_same_tensors(model_snapshot(state["model"]), expected_model)
    restored_opt = state["optimizer"].state_dict()
    for pid, entry in expected_opt.items():
        for name, value in entry.items():
            assert torch.equal(restored_opt["state"][pid][name], value)
    assert state["scheduler"].get_last_lr() == expected_lr
    # The dict entry and the list inside it keep their identity.
    assert state["meta"] is meta and meta["history"] is history
    assert meta == expected_meta


def test_fresh_objects_and_empty_optimizer_state(store: Path):
    state = make_training_state(seed=1)
    train_steps(state, 4)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(4, state)
    fresh = make_training_state(seed=99)  # new objects; optimizer has taken no step
    assert fresh["optimizer"].state_dict()["state"] == {}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.restore(fresh)
    assert_same_tensors(model_snapshot(fresh["model"]), model_snapshot(state["model"]))
    # Continuing both from the same global RNG gives the same numbers.
    global_rng = cv.RNGState().state_dict()
    train_steps(state, 2)
    cv.RNGState().load_state_dict(global_rng)
    train_steps(fresh, 2)
    assert_same_tensors(model_snapshot(fresh["model"]), model_snapshot(state["model"]))
    assert fresh["meta"] == state["meta"]


def test_optimizer_saved_before_any_step_restores(store: Path):
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(0, {"model": model, "optimizer": opt})
        model2 = torch.nn.Linear(3, 3)
        opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
        mgr.restore({"model": model2, "optimizer": opt2})
    assert opt2.param_groups[0]["lr"] == 0.1
    assert opt2.state_dict()["state"] == {}
    assert torch.equal(model2.weight, model.weight)


def test_schedulers_scaler_and_plateau(store: Path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    lam = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9**e)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0)  # holds inf
    onecycle_opt = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    onecycle = torch.optim.lr_scheduler.OneCycleLR(onecycle_opt, max_lr=1.0, total_steps=100)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for _ in range(3):
        opt.step()
        lam.step()
        onecycle_opt.step()
        onecycle.step()
    plateau.step(1.0)
    plateau.step(2.0)
    state = {"opt": opt, "lam": lam, "plateau": plateau, "onecycle": onecycle, "scaler": scaler}
    expected = {k: v.state_dict() for k, v in state.items() if k != "opt"}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(3, state)
    opt2 = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0, momentum=0.9)
    onecycle_opt2 = torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1)
    fresh = {
        "opt": opt2,
        "lam": torch.optim.lr_scheduler.LambdaLR(opt2, lambda e: 0.9**e),
        "plateau": torch.optim.lr_scheduler.ReduceLROnPlateau(opt2, patience=0),
        "onecycle": torch.optim.lr_scheduler.OneCycleLR(onecycle_opt2, max_lr=1.0, total_steps=100),
        "scaler": torch.amp.GradScaler("cpu", init_scale=2.0),
    }
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.restore(fresh)
    for key, value in expected.items():
        got = fresh[key].state_dict()
        assert got.keys() == value.keys(), key
        for name in value:
            if name in ("lr_lambdas", "anneal_func"):
                continue
            assert got[name] == value[name] or (
                isinstance(value[name], float) and np.isnan(value[name])
            ), (key, name)
    assert fresh["scaler"].get_scale() == 1024.0


def test_generators_restored_in_place_and_save_draws_nothing(store: Path):
    np_gen = np.random.default_rng(7)
    mt_gen = np.random.Generator(np.random.MT19937(3))
    torch_gen = torch.Generator().manual_seed(11)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    state = {"np": np_gen, "mt": mt_gen, "tg": torch_gen, "rng": cv.RNGState()}

    def next_draws() -> tuple:
        """One draw from every generator in play, independent and global."""
        return (
            np_gen.integers(0, 2**62, 4).tolist(),
            mt_gen.random(3).tolist(),
            torch.randint(0, 2**62, (4,), generator=torch_gen).tolist(),
            random.random(),
            np.random.random(),
            torch.rand(2).tolist(),
        )

    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(0, state)
        # Saving drew from no generator: the next draws equal a copy's next draws.
        expected = next_draws()
        np_gen.random(100)
        torch.rand(50, generator=torch_gen)
        random.seed(123)
        np.random.seed(456)
        torch.manual_seed(789)
        mgr.restore(state)
    assert next_draws() == expected
    assert state["np"] is np_gen and state["tg"] is torch_gen


def test_saving_does_not_touch_global_rngs(store: Path):
    state = make_training_state()
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state().clone())
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, state)
    after = (random.getstate(), np.random.get_state()[1], torch.get_rng_state())
    assert before[0] == after[0]
    assert np.array_equal(before[1], after[1])
    assert torch.equal(before[2], after[2])


def test_plain_values_tensors_and_nested_containers(store: Path):
    ema = torch.arange(4.0)
    inner = {"a": 1}
    lst = [inner, 2]
    state = {
        "step_count": 10,
        "name": "run",
        "ratio": float("nan"),
        "big": 2**100,
        "pair": (1, -0.0),
        "blob": b"\x00\x01",
        "ema": ema,
        "containers": {"list": lst, "deep": {"x": [1, 2, {"y": None}]}},
        "nested_modules": {"heads": [torch.nn.Linear(2, 2), torch.nn.Linear(2, 3)]},
    }
    heads = state["nested_modules"]["heads"]
    weights = [h.weight.detach().clone() for h in heads]
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, state)
        state["step_count"] = 99
        state["ratio"] = 0.0
        ema.zero_()
        inner["a"] = 5
        inner["b"] = 6
        lst.append(3)
        for head in heads:
            torch.nn.init.zeros_(head.weight)
        mgr.restore(state)
    assert state["step_count"] == 10 and np.isnan(state["ratio"])
    assert state["big"] == 2**100 and state["pair"] == (1, -0.0) and state["blob"] == b"\x00\x01"
    assert state["ema"] is ema and torch.equal(ema, torch.arange(4.0))
    assert state["containers"]["list"] is lst and lst[0] is inner and inner == {"a": 1}
    assert lst == [{"a": 1}, 2]
    assert state["nested_modules"]["heads"] is heads
    for head, weight in zip(heads, weights, strict=True):
        assert torch.equal(head.weight, weight)


def test_stateful_dataloader_resumes_mid_epoch(store: Path):
    tdn = pytest.importorskip("torchdata.stateful_dataloader")
    data = list(range(40))

    def loader():
        return tdn.StatefulDataLoader(
            data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(0)
        )

    first = loader()
    iterator = iter(first)
    for _ in range(3):
        next(iterator)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(3, {"loader": first})
        expected_rest = [batch.tolist() for batch in iterator]
        second = loader()
        mgr.restore({"loader": second})
    assert [batch.tolist() for batch in second] == expected_rest


def test_unsupported_value_fails_before_anything_is_written(store: Path):
    state = {"model": torch.nn.Linear(2, 2), "meta": {"callback": print}}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        with pytest.raises(UnsupportedValueError, match=r"state\['meta'\]\['callback'\]"):
            mgr.save(0, state)
        assert mgr.generations() == []


def test_paths_may_be_pathlike_or_str(tmp_path: Path):
    for directory in (tmp_path / "a", str(tmp_path / "b")):
        with cv.CheckpointManager(directory, run_id="r") as mgr:
            mgr.save(0, {"x": torch.ones(2)})
            assert len(mgr.generations()) == 1


def test_bad_steps_are_usage_errors(store: Path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        for bad in (-1, 1.5, True, "3"):
            with pytest.raises(UsageError):
                mgr.save(bad, {"x": torch.ones(1)})
    with pytest.raises(UsageError, match="closed"):
        mgr.save(1, {"x": torch.ones(1)})


def test_dtypes_roundtrip(store: Path):
    tensors = {
        str(dtype): (torch.arange(6).reshape(2, 3) % 2).to(dtype)
        for dtype in (
            torch.float32,
            torch.float64,
            torch.float16,
            torch.bfloat16,
            torch.int8,
            torch.uint8,
            torch.int16,
            torch.int32,
            torch.int64,
            torch.bool,
            torch.complex64,
            torch.float8_e4m3fn,
            torch.float8_e5m2,
            torch.uint16,
            torch.uint32,
            torch.uint64,
        )
    }
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.empty(0, 4)
    tensors["noncontig"] = torch.arange(12.0).reshape(3, 4).t()
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(0, {"t": tensors})
        restored = {"t": {}}
        mgr.restore(restored)
    for key, value in tensors.items():
        got = restored["t"][key]
        assert got.dtype == value.dtype and got.shape == value.shape, key
        assert torch.equal(
            got.view(torch.uint8)
            if got.dtype.is_floating_point and got.element_size() == 1
            else got,
            value.contiguous().view(torch.uint8)
            if got.dtype.is_floating_point and got.element_size() == 1
            else value,
        ), key


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (np.ma.masked_array([1, 2], mask=[0, 1]), "subclasses"),
        ("lone \ud800 surrogate", "surrogate"),
        (np.longdouble(1.5), "scalars"),
        (torch.zeros(2, dtype=torch.complex128), "complex128"),
    ],
)
def test_values_refused_before_any_io(store: Path, value, fragment):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        with pytest.raises(UnsupportedValueError, match=fragment):
            mgr.save(1, {"meta": {"v": value}})
        assert not store.exists() or not list((store / ".staging").glob("*"))
        assert mgr.generations() == []


def test_state_must_be_a_mapping(store: Path):
    with cv.CheckpointManager(store, run_id="r") as mgr, pytest.raises(UsageError):
        mgr.save(1, [torch.ones(1)])


def test_a_dropped_manager_releases_the_store(store: Path):
    import gc

    first = cv.CheckpointManager(store, run_id="r")
    first.save(1, {"x": torch.ones(1)})
    del first
    gc.collect()
    with cv.CheckpointManager(store, run_id="r") as second:
        second.save(2, {"x": torch.ones(1)})
