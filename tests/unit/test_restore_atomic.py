"""A restore that fails while applying touches nothing it can put back.

Planning refuses what it can see before anything is applied; these are the failures
it cannot see: an object's own ``load_state_dict`` refusing a value. Every step run
before the failure is undone (optimizer, scheduler, containers, RNG), and the error
says nothing was restored; where an in-place load had begun, it names what changed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import StateMismatchError


class Refuses:
    """A stateful object whose load refuses once ``refuse`` is set."""

    def __init__(self) -> None:
        self.value = 1
        self.refuse = False

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.refuse:
            raise ValueError("this object refuses the value")
        self.value = state["value"]


class RefusingModule(torch.nn.Linear):
    """A module whose own load code refuses after copying its weight in place."""

    refuse = False

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        with torch.no_grad():
            self.weight.copy_(state_dict[prefix + "weight"])
        if self.refuse:
            raise RuntimeError("this module refuses its bias")
        super()._load_from_state_dict(state_dict, prefix, *args)


def _trained_state(module: torch.nn.Module) -> dict[str, Any]:
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    module(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return {
        "a_optimizer": optimizer,
        "b_scheduler": scheduler,
        "c_object": Refuses(),
        "model": module,
        "meta": {"tokens": 1, "names": ["a"]},
        "rng": cv.RNGState(),
    }


def _snapshot(state: dict[str, Any]) -> dict[str, Any]:
    return {
        "optimizer": copy.deepcopy(state["a_optimizer"].state_dict()),
        "scheduler": copy.deepcopy(state["b_scheduler"].state_dict()),
        "object": state["c_object"].value,
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "meta": copy.deepcopy(state["meta"]),
        "draw": torch.get_rng_state(),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _save_then_diverge(store: Path, module: torch.nn.Module) -> dict[str, Any]:
    torch.manual_seed(0)
    state = _trained_state(module)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, state)
    # The live objects move on: another step, other values everywhere.
    state["model"](torch.full((2, 4), 2.0)).sum().backward()
    state["a_optimizer"].step()
    state["b_scheduler"].step()
    state["c_object"].value = 2
    state["meta"]["tokens"], state["meta"]["names"] = 2, ["b", "c"]
    torch.manual_seed(5)
    return state


def test_an_object_refusing_its_value_leaves_every_object_as_it_was(tmp_path: Path) -> None:
    state = _save_then_diverge(tmp_path / "store", torch.nn.Linear(4, 3))
    state["c_object"].refuse = True
    before = _snapshot(state)
    with (
        cv.CheckpointManager(tmp_path / "store", run_id="r") as mgr,
        pytest.raises(StateMismatchError) as caught,
    ):
        mgr.restore(state)
    message = str(caught.value)
    assert "state['c_object']" in message and "this object refuses the value" in message
    assert "nothing was restored" in message and "partially" not in message
    # The optimizer and scheduler loaded before the refusal, and were put back.
    assert _same(_snapshot(state), before)


def test_a_module_refusing_mid_load_is_named_and_the_rest_put_back(tmp_path: Path) -> None:
    state = _save_then_diverge(tmp_path / "store", RefusingModule(4, 3))
    RefusingModule.refuse = True
    try:
        before = _snapshot(state)
        with (
            cv.CheckpointManager(tmp_path / "store", run_id="r") as mgr,
            pytest.raises(StateMismatchError) as caught,
        ):
            mgr.restore(state)
    finally:
        RefusingModule.refuse = False
    message = str(caught.value)
    assert "this module refuses its bias" in message
    assert "state['model'] already hold the checkpoint's values" in message
    after = _snapshot(state)
    assert not _same(after["model"]["weight"], before["model"]["weight"])  # copied in place
    del after["model"], before["model"]
    assert _same(after, before)  # everything that could be undone was
