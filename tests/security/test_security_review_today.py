"""Security review of the day's features: regressions for what it found.

Each test plays a writer of the store (an unsigned store takes any generation a
writer makes) or a hostile source, and checks the contract: a typed error before
anything is applied, bounded and escaped messages, a fallback that is reported, and
an export that refuses rather than fills the disk.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import StateMismatchError, StorageFullError
from ckptvault.ops.export import export_weights
from ckptvault.state.gradients import GRADIENTS
from support.common import only_tensor_file, writable


class _ForgedSlots:
    """Saves as ckptvault's GradientSlots would, with whatever gradients it is given
    (what a writer of an unsigned store can put in a generation)."""

    def __init__(self, grads: dict[str, Any]) -> None:
        self.grads = grads

    def state_dict(self) -> dict[str, Any]:
        return self.grads

    def load_state_dict(self, state: Any) -> None:
        raise AssertionError("never restored into")


_ForgedSlots.__module__ = "ckptvault.state.gradients"
_ForgedSlots.__name__ = _ForgedSlots.__qualname__ = "GradientSlots"


@pytest.mark.parametrize(
    "grads",
    [
        {"weight": torch.zeros(7), "bias": torch.zeros(4)},  # wrong shape
        {"weight": {"not": "a tensor"}},  # wrong type
        {"weight": torch.zeros(4, 4, dtype=torch.int64)},  # not a gradient dtype
    ],
    ids=["shape", "type", "dtype"],
)
def test_a_hostile_gradient_slot_is_refused_before_anything_is_applied(store: Path, grads):
    torch.manual_seed(0)
    saved = torch.nn.Linear(4, 4)
    # "Model" sorts before the gradients entry: its weights would be applied first.
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"Model": saved, GRADIENTS: {"Model": _ForgedSlots(grads)}})
    torch.manual_seed(1)
    live = torch.nn.Linear(4, 4)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with (
        cv.CheckpointManager(store, run_id="r") as mgr,
        pytest.raises(StateMismatchError) as caught,
    ):
        mgr.restore({"Model": live})
    assert "['Model']['weight']: checkpoint gradient" in str(caught.value)
    assert "partially restored" not in str(caught.value)
    assert all(torch.equal(before[k], v) for k, v in live.state_dict().items())
    assert live.weight.grad is None


def test_hostile_saved_versions_are_shown_bounded_and_escaped(store: Path, monkeypatch):
    hostile = {
        "ckptvault": "0\x1b]0;pwned\x07\x1b[2J",
        "torch": "9" * 10_000,
        "numpy": {"nested": list(range(100_000))},
        "python": "3",
        "cuda": None,
        "cuda_devices": 99,
    }
    monkeypatch.setattr("ckptvault.state.contract.environment_versions", lambda: hostile)
    with cv.CheckpointManager(store, run_id="r", contract={"c": 1}) as mgr:
        mgr.save(1, {"meta": {"x": 1}})
    monkeypatch.undo()
    with cv.CheckpointManager(store, run_id="r", contract={"c": 1}) as mgr:
        info = mgr.restore({"meta": {"x": 0}})
    assert info is not None and len(info.environment) >= 3
    for line in info.environment:
        assert line.isprintable() and len(line) < 200, line
    assert any("\\x1b]0;pwned" in line for line in info.environment)


def test_warm_start_reports_the_newer_source_generations_it_skipped(tmp_path: Path):
    source = tmp_path / "pretrain"
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    with cv.CheckpointManager(source, run_id="pretrain") as mgr:
        mgr.save(900, {"model": model})
        mgr.save(1000, {"model": model})
        newest = Path(mgr.generations()[0].path)
    shard = only_tensor_file(newest)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    writable(shard).write_bytes(bytes(data))
    with cv.CheckpointManager(tmp_path / "finetune", run_id="finetune") as mgr:
        info = mgr.warm_start({"model": torch.nn.Linear(8, 8)}, source, source_run_id="pretrain")
    assert info.step == 900
    assert [s.step for s in info.skipped] == [1000] and "digest" in info.skipped[0].reason


def test_an_export_whose_tied_names_outgrow_the_disk_is_refused_before_writing(
    store: Path, tmp_path: Path
):
    tensor = torch.zeros(4 * 1024 * 1024, dtype=torch.uint8)  # 4 MiB, stored once
    out = tmp_path / "out" / "weights.safetensors"
    out.parent.mkdir()
    names = shutil.disk_usage(out.parent).free // tensor.nbytes + 2
    tree = {f"alias{i}": tensor for i in range(names)}  # one tensor, many names
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"model": tree})
        assert mgr.generations()[0].bytes < 2 * tensor.nbytes
    with pytest.raises(StorageFullError, match="tied to other tensors"):
        export_weights(store, 1, out, key="model")
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize(
    "change",
    [{"global_step": "7"}, {"global_step": 3}, {"max_steps": [1]}, {"epoch": {"a": 1}}],
    ids=["step-text", "step-other", "max-steps-list", "epoch-dict"],
)
def test_a_hostile_trainer_state_is_refused_before_trainer_reads_it(change: dict):
    pytest.importorskip("transformers")
    import dataclasses

    from transformers import TrainerState

    from ckptvault.integrations.huggingface import _trainer_state

    saved = dataclasses.asdict(TrainerState(global_step=7, max_steps=10, epoch=0.5))
    assert _trainer_state(saved, 7).global_step == 7
    with pytest.raises(StateMismatchError, match="TrainerState of the generation of step 7"):
        _trainer_state({**saved, **change}, 7)
