"""Restore compares the environment with the one the generation was saved in:
versions and CUDA devices differ -> listed and warned about, refused under
strict_env=True; CUDA RNG states for another device count are never dropped."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import ckptvault as cv
import ckptvault.state.contract as contract_module
import ckptvault.state.rng as rng_module
from ckptvault.errors import EnvironmentMismatch, StateMismatchError
from ckptvault.state.environment import environment_versions


def save_as_if(store: Path, monkeypatch: pytest.MonkeyPatch, **versions) -> torch.nn.Module:
    """Save one generation whose manifest records ``versions`` as its environment."""
    recorded = {**environment_versions(), **versions}
    monkeypatch.setattr(contract_module, "environment_versions", lambda: recorded)
    model = torch.nn.Linear(3, 3)
    with cv.CheckpointManager(store, run_id="env") as mgr:
        mgr.save(1, {"model": model})
    monkeypatch.undo()
    return model


def test_every_manifest_records_the_environment(store: Path):
    with cv.CheckpointManager(store, run_id="env") as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        generation = Path(mgr.generations()[0].path)
    versions = json.loads((generation / "manifest.json").read_text())["contract"]["versions"]
    assert versions == environment_versions()
    assert set(versions) >= {"torch", "numpy", "python", "ckptvault", "cuda", "cuda_devices"}


def test_a_different_environment_is_listed_and_warned_about(store, monkeypatch, caplog):
    saved = save_as_if(store, monkeypatch, torch="2.12.0", cuda_devices=8, cuda="12.4")
    live = torch.nn.Linear(3, 3)
    with (
        caplog.at_level(logging.WARNING, logger="ckptvault"),
        cv.CheckpointManager(store, run_id="env") as mgr,
    ):
        info = mgr.restore({"model": live})
    assert info is not None
    now = environment_versions()
    assert f"torch: 2.12.0 (saved) -> {now['torch']} (now)" in info.environment
    assert f"CUDA devices: 8 (saved) -> {now['cuda_devices']} (now)" in info.environment
    assert f"CUDA: 12.4 (saved) -> {now['cuda'] or 'none'} (now)" in info.environment
    assert len(info.environment) == 3
    assert "saved in another environment" in caplog.text
    assert torch.equal(live.weight, saved.weight)


def test_strict_env_refuses_and_touches_nothing(store, monkeypatch):
    save_as_if(store, monkeypatch, numpy="1.0.0")
    live = torch.nn.Linear(3, 3)
    before = live.weight.detach().clone()
    with (
        cv.CheckpointManager(store, run_id="env") as mgr,
        pytest.raises(EnvironmentMismatch, match=r"NumPy: 1\.0\.0") as raised,
    ):
        mgr.restore({"model": live}, strict_env=True)
    assert raised.value.differences[0].startswith("NumPy: 1.0.0 (saved)")
    assert torch.equal(live.weight, before)


def test_the_same_environment_restores_under_strict_env(store):
    with cv.CheckpointManager(store, run_id="env") as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        info = mgr.restore({"w": torch.zeros(2)}, strict_env=True)
    assert info is not None and info.environment == []


def test_cuda_rng_states_of_other_devices_are_never_dropped(store, monkeypatch):
    """Saved on 8 GPUs, restored where there are none: refused, even with strict=False."""
    fake = [torch.zeros(16, dtype=torch.uint8) for _ in range(8)]
    monkeypatch.setattr(rng_module, "_cuda_states", lambda: fake)
    with cv.CheckpointManager(store, run_id="env") as mgr:
        mgr.save(1, {"rng": cv.RNGState()})
    monkeypatch.undo()
    with (
        cv.CheckpointManager(store, run_id="env") as mgr,
        pytest.raises(StateMismatchError, match="8 CUDA devices"),
    ):
        mgr.restore({"rng": cv.RNGState()}, strict=False)
