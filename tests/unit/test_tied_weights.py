"""Tied weights (tensors that share memory, like a tied embedding and LM head) are
written once; restore and export give every name its tensor, and ties stay ties."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

import ckptvault as cv
from ckptvault.ops.export import consolidate_weights, export_weights
from support.forging import read_logical


class TiedLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.body = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.head.weight = self.embed.weight  # tied


def manifest_of(mgr: cv.CheckpointManager) -> dict:
    """The newest generation's logical manifest (format 3: root and indexes merged)."""
    return read_logical(Path(mgr.generations()[0].path))


def test_a_tied_weight_is_written_once_and_restores_as_a_tie(store: Path):
    torch.manual_seed(0)
    model = TiedLM()
    shared = torch.arange(6.0)
    with cv.CheckpointManager(store, run_id="tied") as mgr:
        mgr.save(1, {"model": model, "a": shared, "b": shared, "part": shared[2:]})
        stored = manifest_of(mgr)["dcp"]["tensors"]
        assert "model/head.weight" not in stored and "model/embed.weight" in stored
        assert "b" not in stored and "part" in stored  # a view of part of it is its own
        assert mgr.generations()[0].bytes < 2 * model.embed.weight.nbytes

        torch.manual_seed(1)
        live = TiedLM()
        state = {"model": live, "a": None, "b": None, "part": None}
        info = mgr.restore(state)
    assert info is not None and info.loaded[0] == "state['model'] (4 of 4 keys)"
    assert live.head.weight is live.embed.weight
    assert torch.equal(live.embed.weight, model.embed.weight)
    assert state["a"] is state["b"] and torch.equal(state["a"], shared)
    assert torch.equal(state["part"], shared[2:])


def test_an_export_names_every_tied_weight(store: Path, tmp_path: Path):
    torch.manual_seed(0)
    model = TiedLM()
    with cv.CheckpointManager(store, run_id="tied") as mgr:
        mgr.save(1, {"model": model})
    out = tmp_path / "model.safetensors"
    result = export_weights(store, 1, out)
    exported = load_file(out)
    assert set(exported) == set(model.state_dict()) and result.tensors == 4
    assert torch.equal(exported["head.weight"], model.embed.weight.detach())
    assert torch.equal(exported["embed.weight"], model.embed.weight.detach())


def test_a_consolidation_names_every_tied_weight_and_loads_strictly(store: Path, tmp_path: Path):
    """ckptvault consolidate wrote embed.weight but not head.weight (export kept both):
    a strict load_state_dict of the consolidated files failed."""
    torch.manual_seed(0)
    model = TiedLM()
    with cv.CheckpointManager(store, run_id="tied") as mgr:
        mgr.save(1, {"model": model})
    result = consolidate_weights(store, tmp_path / "hf")
    consolidated = load_file(tmp_path / "hf" / "model.safetensors")
    assert set(consolidated) == set(model.state_dict()) and result.tensors == 4
    fresh = TiedLM()
    fresh.load_state_dict(consolidated, strict=True)
    assert torch.equal(fresh.head.weight, model.embed.weight)
