"""Optimizer state keyed by parameter name: moments follow their parameters when
layers are inserted, frozen or regrouped between save and restore; generations keyed
by position still restore."""

from __future__ import annotations

import itertools
from pathlib import Path

import torch

import ckptvault as cv
from support.forging import read_logical


def _net(*widths: int) -> torch.nn.Sequential:
    layers = [torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths)]
    return torch.nn.Sequential(*layers)


def _trained(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    torch.manual_seed(0)
    for _ in range(2):
        model(torch.randn(3, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def _moments(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(p)]: state["exp_avg"].clone()
        for p, state in optimizer.state.items()
        if "exp_avg" in state
    }


def test_the_state_is_stored_under_parameter_names(store: Path):
    model = _net(4, 4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    _trained(model, optimizer)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"model": model, "optim": optimizer})
        keys = set(read_logical(Path(mgr.generations()[0].path))["dcp"]["tensors"])
    assert "optim/state/0.weight/exp_avg" in keys and "optim/state/1.bias/exp_sq" not in keys
    assert "optim/state/1.bias/exp_avg_sq" in keys and not any("/state/0/" in k for k in keys)


def test_an_inserted_layer_gets_no_moments_and_the_others_keep_theirs(store: Path):
    """Saved: 0 -> 1. Restored into 0 -> new -> 2 (named so: a Sequential's second
    layer would be "1"): with positions, the new layer took layer 1's moments, or the
    load failed on shapes."""
    model = torch.nn.Sequential()
    model.add_module("first", torch.nn.Linear(4, 4))
    model.add_module("last", torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    _trained(model, optimizer)
    saved = _moments(optimizer, model)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"model": model, "optim": optimizer})

    grown = torch.nn.Sequential()
    grown.add_module("first", torch.nn.Linear(4, 4))
    grown.add_module("middle", torch.nn.Linear(4, 4))
    grown.add_module("last", torch.nn.Linear(4, 2))
    fresh = torch.optim.AdamW(grown.parameters())
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore({"model": grown, "optim": fresh}, strict=False)
    assert info is not None
    assert "state['optim']['state']['middle.weight']" in info.missing
    assert "state['model']['middle.weight']" in info.missing
    restored = _moments(fresh, grown)
    assert set(restored) == {"first.weight", "first.bias", "last.weight", "last.bias"}
    assert all(torch.equal(restored[name], saved[name]) for name in restored)


def test_a_frozen_layer_leaves_the_optimizer_and_the_rest_keep_their_moments(store: Path):
    model = _net(4, 4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    _trained(model, optimizer)
    saved = _moments(optimizer, model)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"model": model, "optim": optimizer})

    again = _net(4, 4, 2)
    for param in again[0].parameters():
        param.requires_grad_(False)
    fresh = torch.optim.AdamW([p for p in again.parameters() if p.requires_grad])
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore({"model": again, "optim": fresh}, strict=False)
    assert info is not None
    assert sorted(info.unexpected) == [
        "state['optim']['state']['0.bias']",
        "state['optim']['state']['0.weight']",
    ]
    restored = _moments(fresh, again)
    assert set(restored) == {"1.weight", "1.bias"}
    assert all(torch.equal(restored[name], saved[name]) for name in restored)


def test_reordered_parameter_groups_keep_their_own_hyperparameters(store: Path):
    model = _net(4, 4, 2)
    optimizer = torch.optim.AdamW(
        [
            {"params": model[0].parameters(), "lr": 0.1},
            {"params": model[1].parameters(), "lr": 0.01, "weight_decay": 0.5},
        ]
    )
    _trained(model, optimizer)
    saved = _moments(optimizer, model)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"model": model, "optim": optimizer})

    again = _net(4, 4, 2)
    fresh = torch.optim.AdamW(
        [
            {"params": again[1].parameters(), "lr": 1.0},
            {"params": again[0].parameters(), "lr": 1.0},
        ]
    )
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert mgr.restore({"model": again, "optim": fresh}) is not None
    groups = fresh.param_groups
    assert (groups[0]["lr"], groups[0]["weight_decay"]) == (0.01, 0.5)  # layer 1's group
    assert groups[1]["lr"] == 0.1  # layer 0's group
    restored = _moments(fresh, again)
    assert set(restored) == set(saved)
    assert all(torch.equal(restored[name], saved[name]) for name in saved)


def test_a_generation_keyed_by_position_still_restores(store: Path):
    """An optimizer saved without its model is keyed by position, as every
    generation written before names were used: it restores as it always did."""
    model = _net(4, 4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    _trained(model, optimizer)
    saved = _moments(optimizer, model)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"optim": optimizer})
        keys = set(read_logical(Path(mgr.generations()[0].path))["dcp"]["tensors"])
    assert "optim/state/0/exp_avg" in keys
    again = _net(4, 4, 2)
    fresh = torch.optim.AdamW(again.parameters())
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert mgr.restore({"optim": fresh}) is not None
    restored = _moments(fresh, again)
    assert all(torch.equal(restored[name], saved[name]) for name in saved)


def test_saved_state_no_group_holds_is_unexpected_not_dropped(store: Path):
    """A name-keyed generation whose state names a parameter no group lists (a
    hand-edited or forged one) reports it, as a module's stray key is reported."""
    model = _net(4, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    _trained(model, optimizer)
    from ckptvault.state.param_names import NamedState, by_name, parameter_names

    names = parameter_names({"model": model})
    saved = by_name(optimizer, names, optimizer.state_dict())
    assert saved is not None
    saved["state"]["ghost.weight"] = saved["state"]["0.weight"]
    named = NamedState(torch.optim.AdamW(model.parameters()), saved, names)
    assert named.unexpected == ["ghost.weight"] and named.missing == []
