"""Restores into the live tensors (``restore(..., in_place=True)``).

What a user relies on: the state comes back bit for bit; the restore needs no second
copy of the state in memory (the resident set's peak, measured in a process of its
own); a generation that fails verification is passed over with nothing changed, as
without ``in_place``; and a file that changes between the verifying pass and the
reading pass is reported as what it is: an ``IntegrityError`` saying the live
tensors were partly overwritten and the state must be restored again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import IntegrityError, NoValidCheckpoint
from ckptvault.io import in_place
from support.forkserver import server

WORKER = Path(__file__).resolve().parents[1] / "support" / "in_place_worker.py"


def state_of(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(3, 64)).sum().backward()
    optimizer.step()
    return {
        "model": model,
        "optim": optimizer,
        "table": torch.randn(128, 128),
        "half": torch.randn(128, 128).half(),  # saved half, restored into a float32
        "rng": cv.RNGState(),
        "meta": {"seed": seed},
    }


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    optimizer = state["optim"]
    return {
        "model": {k: v.clone() for k, v in state["model"].state_dict().items()},
        "moments": [{k: v.clone() for k, v in s.items()} for s in optimizer.state.values()],
        "table": state["table"].clone(),
        "half": state["half"].clone(),
        "meta": dict(state["meta"]),
    }


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@pytest.fixture
def two_steps(tmp_path: Path) -> tuple[Path, list[dict[str, Any]]]:
    store = tmp_path / "store"
    saved = []
    with cv.CheckpointManager(store, run_id="run") as mgr:
        for step in (1, 2):
            state = state_of(step)
            mgr.save(step, state)
            saved.append(snapshot(state))
    return store, saved


def live_state() -> dict[str, Any]:
    state = state_of(99)
    state["half"] = torch.zeros(128, 128)  # another dtype: read privately, then cast
    return state


def newest_file(store: Path, step: int) -> Path:
    [generation] = store.glob(f"step-{step:012d}.*")
    return next(generation.glob("*.safetensors"))


def flip(path: Path, offset: int) -> None:
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def test_in_place_restore_is_bit_exact_and_keeps_the_live_tensors(two_steps):
    store, saved = two_steps
    state = live_state()
    table, weight = state["table"], state["model"][0].weight
    with cv.CheckpointManager(store, run_id="run") as mgr:
        info = mgr.restore(state, in_place=True)
    assert info is not None and info.step == 2
    expected = {**saved[1], "half": saved[1]["half"].float()}
    assert same(snapshot(state), expected)
    assert state["table"] is table and state["model"][0].weight is weight
    assert info.casts == ["state['half']: torch.float16 -> torch.float32"]


def test_an_encrypted_generation_is_decrypted_into_the_live_tensors(tmp_path):
    keys = tmp_path / "keys"
    saved = state_of(1)
    with cv.CheckpointManager(tmp_path / "store", run_id="run", keystore=keys) as mgr:
        mgr.save(1, saved)
        state = live_state()
        info = mgr.restore(state, in_place=True)
    assert info is not None and info.step == 1
    assert same(snapshot(state), {**snapshot(saved), "half": saved["half"].float()})


def test_a_corrupt_generation_is_passed_over_with_the_state_untouched(two_steps):
    store, saved = two_steps
    flip(newest_file(store, 2), -100)  # the last tensor's bytes
    state = live_state()
    with cv.CheckpointManager(store, run_id="run") as mgr:
        info = mgr.restore(state, in_place=True)
        assert info is not None and info.step == 1
        assert [s.step for s in info.skipped] == [2]
        assert same(snapshot(state), {**saved[0], "half": saved[0]["half"].float()})
        flip(newest_file(store, 1), -100)
        state = live_state()
        before = snapshot(state)
        with pytest.raises(NoValidCheckpoint):
            mgr.restore(state, in_place=True)
    assert same(snapshot(state), before)


def test_a_file_changed_between_the_passes_says_the_live_tensors_were_overwritten(
    two_steps, monkeypatch
):
    store, saved = two_steps
    data = newest_file(store, 2)
    read_in_place = in_place.read_in_place

    def changed_in_between(pending: Any, destinations: Any) -> None:
        flip(data, data.stat().st_size - 100)  # after pass 1 verified it
        read_in_place(pending, destinations)

    monkeypatch.setattr(in_place, "read_in_place", changed_in_between)
    state = live_state()
    rng_before = torch.get_rng_state()
    mgr = cv.CheckpointManager(store, run_id="run")
    with pytest.raises(IntegrityError) as raised:
        mgr.restore(state, in_place=True)
    message = str(raised.value)
    assert "changed while it was restored in place" in message
    assert "partly overwritten" in message and "restore it again" in message
    assert state["meta"] == {"seed": 99}  # nothing but tensor bytes was applied
    assert torch.equal(torch.get_rng_state(), rng_before)
    # Restored again, the changed generation is passed over: the state is whole.
    monkeypatch.undo()
    info = mgr.restore(state, in_place=True)
    mgr.close()
    assert info is not None and info.step == 1
    assert same(snapshot(state), {**saved[0], "half": saved[0]["half"].float()})


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc")
def test_in_place_restore_needs_no_second_copy_of_the_state(tmp_path):
    """Peak resident memory during the restore, above where it stood just before
    (interpreter and live state), in a process of its own: a plain restore holds a
    private copy of the state; in place, at most 64 MiB of buffers."""
    env = dict(os.environ, IN_PLACE_MB="192")
    store = tmp_path / "store"
    reports = {}
    for mode in ("save", "restore", "restore_in_place"):
        out = tmp_path / f"{mode}.json"
        job = server().start(WORKER, [mode, str(store), str(out)], env, tmp_path / f"{mode}.log")
        assert job.wait(timeout=300) == 0, (tmp_path / f"{mode}.log").read_text()[-3000:]
        reports[mode] = json.loads(out.read_text())
    private, direct = reports["restore"], reports["restore_in_place"]
    assert private["exact"] and direct["exact"]
    mib = 2**20
    assert direct["state"] > 160 * mib
    assert private["extra"] > direct["state"] / 2, private  # the measure sees a copy
    assert direct["extra"] <= 64 * mib, direct
