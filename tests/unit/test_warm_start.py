"""Fine-tuning from another run: warm_start reads the source run read-only under its
own trust policy, restores what matches, and records the lineage in every manifest
the new run writes."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import NoValidCheckpoint, UsageError
from ckptvault.trust.signing import generate_keypair


class Backbone(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 4)  # pretraining head


class FineTune(torch.nn.Module):
    """The same encoder under a new name, and a new head for another task."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = torch.nn.Linear(8, 16)
        self.classifier = torch.nn.Linear(16, 2)


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root`` with its mode and content digest."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
            found[str(path.relative_to(root))] = f"{oct(path.stat().st_mode)} {digest}"
    return found


@pytest.fixture
def pretrained(tmp_path: Path) -> tuple[Path, Backbone]:
    generate_keypair(tmp_path / "pre.pem", tmp_path / "pre.pub")
    torch.manual_seed(0)
    model = Backbone()
    source = tmp_path / "pretrain"
    with cv.CheckpointManager(source, run_id="pretrain", signing_key=tmp_path / "pre.pem") as mgr:
        mgr.save(900, {"model": model})
        model.encoder.weight.data.add_(1.0)
        mgr.save(1000, {"model": model})
    return source, model


def fine_tune_state() -> dict:
    torch.manual_seed(7)
    model = FineTune()
    return {"model": model, "optimizer": torch.optim.AdamW(model.parameters()), "meta": {"step": 0}}


def test_warm_start_restores_what_matches_and_never_touches_the_source(tmp_path, pretrained):
    source, pre = pretrained
    before = snapshot(source)
    state = fine_tune_state()
    with cv.CheckpointManager(tmp_path / "finetune", run_id="finetune") as mgr:
        info = mgr.warm_start(
            {"model": state["model"]},
            source,
            source_run_id="pretrain",
            trusted_keys=[tmp_path / "pre.pub"],
            rename={"encoder.": "backbone."},
            strict=False,
        )
        assert info.step == 1000 and info.signer is not None
        assert info.lineage is not None
        assert info.lineage.run_id == "pretrain" and info.lineage.step == 1000
        assert sorted(info.unexpected) == [
            "state['model']['head.bias']",
            "state['model']['head.weight']",
        ]
        assert sorted(info.missing) == [
            "state['model']['classifier.bias']",
            "state['model']['classifier.weight']",
        ]
        assert torch.equal(state["model"].backbone.weight, pre.encoder.weight)
        mgr.save(1, state)
        generation = Path(mgr.generations()[0].path)
    contract = json.loads((generation / "manifest.json").read_text())["contract"]
    assert contract["lineage"] == {
        "run_id": "pretrain",
        "step": 1000,
        "generation_id": info.generation_id,
        "store": info.path,
    }
    assert snapshot(source) == before  # no lease, mark, record or byte written there


def test_the_lineage_survives_a_restart_of_the_new_run(tmp_path, pretrained):
    source, _ = pretrained
    store = tmp_path / "finetune"
    state = fine_tune_state()
    with cv.CheckpointManager(store, run_id="finetune") as mgr:
        mgr.warm_start(
            {"model": state["model"]},
            source,
            source_run_id="pretrain",
            rename={"encoder.": "backbone."},
            strict=False,
            step=900,
        )
        mgr.save(1, state)
    resumed = fine_tune_state()
    with cv.CheckpointManager(store, run_id="finetune") as mgr:
        info = mgr.restore(resumed)
        assert info is not None and info.lineage is not None and info.lineage.step == 900
        mgr.save(2, resumed)
        newest = Path(mgr.generations()[0].path)
        # warm_start is for a new run only: after a crash, restore() resumes it
        with pytest.raises(UsageError, match="resume this one with restore"):
            mgr.warm_start(resumed, source, source_run_id="pretrain")
    assert json.loads((newest / "manifest.json").read_text())["contract"]["lineage"]["step"] == 900


def test_the_source_is_held_to_its_own_trust_policy(tmp_path, pretrained):
    source, _ = pretrained
    generate_keypair(tmp_path / "other.pem", tmp_path / "other.pub")
    state = fine_tune_state()
    before = state["model"].backbone.weight.detach().clone()
    with cv.CheckpointManager(tmp_path / "finetune", run_id="finetune") as mgr:
        with pytest.raises(NoValidCheckpoint):
            mgr.warm_start(
                {"model": state["model"]},
                source,
                source_run_id="pretrain",
                trusted_keys=[tmp_path / "other.pub"],
                strict=False,
            )
        with pytest.raises(NoValidCheckpoint):  # a run the source store does not hold
            mgr.warm_start(
                {"model": state["model"]}, source, source_run_id="elsewhere", strict=False
            )
        assert mgr.generations() == []
    assert torch.equal(state["model"].backbone.weight, before)


def test_warm_start_without_rename_refuses_a_model_nothing_matches(tmp_path, pretrained):
    source, _ = pretrained
    state = fine_tune_state()
    with (
        cv.CheckpointManager(tmp_path / "finetune", run_id="finetune") as mgr,
        pytest.raises(cv.errors.StateMismatchError, match="none of the checkpoint's"),
    ):
        mgr.warm_start({"model": state["model"]}, source, source_run_id="pretrain", strict=False)
