"""No pickle on any path: save and restore work with every pickle entry point
patched to raise, and the tensor files open with stock safetensors."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import ckptvault as cv
from support.common import make_training_state, model_snapshot, train_steps


class PickleUsed(AssertionError):
    pass


def _refuse(*args, **kwargs):
    raise PickleUsed("pickle was used")


class _RefusingClass:
    def __init__(self, *args, **kwargs):
        raise PickleUsed("pickle class was instantiated")


def test_save_and_restore_never_pickle(store: Path, monkeypatch: pytest.MonkeyPatch):
    state = make_training_state()
    train_steps(state, 3)
    expected = model_snapshot(state["model"])
    for name in ("dump", "dumps", "load", "loads"):
        monkeypatch.setattr(pickle, name, _refuse)
    monkeypatch.setattr(pickle, "Pickler", _RefusingClass)
    monkeypatch.setattr(pickle, "Unpickler", _RefusingClass)
    monkeypatch.setattr(torch, "save", _refuse)
    monkeypatch.setattr(torch, "load", _refuse)
    # The patches are live: anything that pickles fails.
    with pytest.raises(PickleUsed):
        torch.save({}, "/dev/null")
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(3, state)
        fresh = make_training_state(seed=5)
        info = mgr.restore(fresh)
    assert info is not None
    for key, value in expected.items():
        assert torch.equal(fresh["model"].state_dict()[key], value)


def test_tensor_files_open_with_stock_safetensors(store: Path):
    state = make_training_state()
    train_steps(state, 2)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        path = Path(mgr.save(2, state).result().path)
    files = sorted(path.glob("*.safetensors"))
    # Besides the tensor files: the root manifest and (format 3) the rank's index,
    # both canonical JSON.
    listed = {"manifest.json", "r00000-index.json", *(f.name for f in files)}
    assert files and {p.name for p in path.iterdir()} == listed
    found = {}
    for file in files:
        with safe_open(file, framework="pt") as reader:
            assert reader.metadata()["writer"] == "ckptvault"
            for key in reader.keys():  # noqa: SIM118 (safe_open is not iterable)
                found[key] = reader.get_tensor(key)
    for name, value in state["model"].state_dict().items():
        assert torch.equal(found[f"model/{name}"], value)
    assert torch.equal(
        found["optimizer/state/fc1.weight/exp_avg"], state["optimizer"].state_dict()["state"][0]["exp_avg"]
    )


def test_source_tree_has_no_pickle_calls():
    root = Path(__file__).resolve().parents[2] / "src"
    banned = (
        "import pickle",
        "from pickle",
        "torch.load(",
        "torch.save(",
        "weights_only=False",
        "eval(",
        "exec(",
    )
    for path in root.rglob("*.py"):
        text = path.read_text()
        for needle in banned:
            assert needle not in text, f"{path}: contains {needle!r}"
