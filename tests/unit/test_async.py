"""Asynchronous saves: a stall of a memory copy, values as of the call, backpressure,
errors that are never lost, bounded memory, nothing lost at exit."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import KeyUnavailableError
from support.common import REPO, run_cli
from support.keystores import (
    ControlledKeyStore,
    failing_manager,
)


def test_values_are_those_at_the_call(store: Path):
    model = torch.nn.Linear(256, 256)
    meta = {"tokens": 100, "history": [1, 2]}
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    with cv.CheckpointManager(store, run_id="r", async_save=True) as mgr:
        handle = mgr.save(1, {"model": model, "meta": meta})
        with torch.no_grad():  # training moves on the moment save returns
            model.weight.add_(1.0)
            model.bias.zero_()
        meta["tokens"] = 999
        meta["history"].append(3)
        info = handle.result()
        assert info is not None and info.step == 1
        target = {"model": torch.nn.Linear(256, 256), "meta": {}}
        mgr.restore(target)
    for key, value in expected.items():
        assert torch.equal(target["model"].state_dict()[key], value)
    assert target["meta"] == {"tokens": 100, "history": [1, 2]}


def test_steady_state_reuses_staging_buffers(store: Path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 64)).sum().backward()
    opt.step()
    with cv.CheckpointManager(store, run_id="r", async_save=True) as mgr:
        mgr.save(1, {"model": model, "optimizer": opt})
        first = mgr.stats.staging_allocations
        for step in range(2, 6):
            mgr.save(step, {"model": model, "optimizer": opt})
        mgr.wait()
        assert mgr.stats.staging_allocations == first
        assert mgr.stats.saves_completed == 5
        assert [g.step for g in mgr.generations()] == [5, 4, 3, 2, 1]


def test_backpressure_waits_for_the_save_in_flight(store: Path, tmp_path: Path):
    keys = ControlledKeyStore(tmp_path / "keys")
    state = {"x": torch.ones(1000)}
    with cv.CheckpointManager(store, run_id="r", keystore=keys, async_save=True) as mgr:
        keys.gate.clear()  # the first save's writing is held up
        first = mgr.save(1, state)
        returned = threading.Event()

        def second_save() -> None:
            mgr.save(2, state)
            returned.set()

        thread = threading.Thread(target=second_save)
        thread.start()
        assert not returned.wait(timeout=1.0)  # max_in_flight=1: the second save waits
        assert not first.done()
        keys.gate.set()
        assert returned.wait(timeout=30)
        thread.join()
        mgr.wait()
        assert [g.step for g in mgr.generations()] == [2, 1]


def test_backpressure_can_skip_with_a_warning_and_a_count(store: Path, tmp_path: Path):
    keys = ControlledKeyStore(tmp_path / "keys")
    state = {"x": torch.ones(1000)}
    with cv.CheckpointManager(
        store, run_id="r", keystore=keys, async_save=True, if_busy="skip"
    ) as mgr:
        keys.gate.clear()
        mgr.save(1, state)
        with pytest.warns(RuntimeWarning, match="skipped the save of step 2"):
            skipped = mgr.save(2, state)
        assert skipped.skipped and skipped.done() and skipped.result() is None
        assert mgr.stats.saves_skipped == 1
        keys.gate.set()
        mgr.wait()
        assert [g.step for g in mgr.generations()] == [1]




def test_background_error_raised_by_the_handle_once(store: Path, tmp_path: Path):
    mgr, keys = failing_manager(store, tmp_path)
    handle = mgr.save(2, {"x": torch.ones(10)})
    with pytest.raises(KeyUnavailableError, match="unreachable"):
        handle.result()
    mgr.wait()  # already reported: not raised twice
    keys.fail = False
    mgr.close()
    assert [g.step for g in cv.CheckpointManager(store, run_id="r").generations()] == [1]
    assert not list((store / ".staging").iterdir())  # a failed save publishes nothing


def test_background_error_raised_by_the_next_save(store: Path, tmp_path: Path):
    mgr, keys = failing_manager(store, tmp_path)
    mgr.save(2, {"x": torch.ones(10)}).exception()  # wait for it; not yet raised to anyone
    keys.fail = False
    with pytest.raises(KeyUnavailableError):
        mgr.save(3, {"x": torch.ones(10)})
    mgr.save(3, {"x": torch.ones(10)}).result()  # reported once; saving goes on
    mgr.close()


def test_background_error_raised_by_wait_and_by_close(store: Path, tmp_path: Path):
    mgr, _keys = failing_manager(store, tmp_path)
    mgr.save(2, {"x": torch.ones(10)})
    with pytest.raises(KeyUnavailableError):
        mgr.wait()
    mgr.save(3, {"x": torch.ones(10)})
    with pytest.raises(KeyUnavailableError):
        mgr.close()
    # close released the lock even though it raised
    with cv.CheckpointManager(store, run_id="r") as other:
        other.save(4, {"x": torch.ones(10)})


def test_close_and_context_exit_wait_for_saves_in_flight(store: Path, tmp_path: Path):
    keys = ControlledKeyStore(tmp_path / "keys")
    with cv.CheckpointManager(store, run_id="r", keystore=keys, async_save=True) as mgr:
        keys.gate.clear()
        handle = mgr.save(1, {"x": torch.ones(10)})
        threading.Timer(0.5, keys.gate.set).start()
    assert handle.done() and handle.result().step == 1


def test_interpreter_exit_waits_for_saves_in_flight(store: Path):
    code = textwrap.dedent(
        f"""
        import torch, ckptvault as cv
        mgr = cv.CheckpointManager({str(store)!r}, run_id="r", async_save=True)
        mgr.save(7, {{"big": torch.ones(32 * 1024 * 1024)}})  # 128 MiB, then exit at once
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300, cwd=REPO)
    result = run_cli("verify", str(store), "--json")
    assert result.returncode == 0 and json.loads(result.stdout)[0]["step"] == 7


def test_synchronous_save_memory_is_bounded():
    """Peak RSS growth of a 512 MiB synchronous save, measured in a fresh process."""
    code = textwrap.dedent(
        """
        import resource, tempfile, torch, ckptvault as cv
        tensors = {f"t{i}": torch.randn(8 * 1024 * 1024) for i in range(16)}  # 16 x 32 MiB
        store = tempfile.mkdtemp()
        with cv.CheckpointManager(store, run_id="r", threads=2) as mgr:
            mgr.save(0, {"warm": torch.ones(4)})  # load every code path once
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            mgr.save(1, {"weights": tensors})
            after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((after - before) * 1024)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO
    )
    assert result.returncode == 0, result.stderr
    growth = int(result.stdout.strip().splitlines()[-1])
    assert growth < 64 * 1024 * 1024 + 16 * 64 * 1024, f"peak RSS grew by {growth / 2**20:.1f} MiB"


def test_plans_are_reused_while_the_layout_holds(store: Path):
    model = torch.nn.Linear(8, 8)
    with cv.CheckpointManager(store, run_id="r", async_save=True) as mgr:
        for step in range(3):
            mgr.save(step, {"model": model})
        mgr.wait()
        assert mgr.stats.plans_reused == 2
        bigger = {"model": model, "extra": torch.arange(5.0)}  # the layout changes: replan
        mgr.save(3, bigger).result()
        assert mgr.stats.plans_reused == 2
        target = {"model": torch.nn.Linear(8, 8), "extra": torch.zeros(5)}
        assert mgr.restore(target).step == 3
    assert torch.equal(target["extra"], torch.arange(5.0))
    assert torch.equal(target["model"].weight, model.weight)
