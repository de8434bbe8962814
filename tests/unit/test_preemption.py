"""Preemption: a scheduler's signal turns the next save() into a final synchronous
save and an exit with code 75, which a supervisor restarts; a save the deadline cuts
short is never published."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import UsageError
from ckptvault.exit_codes import PREEMPTED
from support.common import REPO
from support.keystores import ControlledKeyStore


def test_a_sigterm_ends_the_job_with_a_final_save_and_exit_code_75(tmp_path: Path):
    store, ready = tmp_path / "store", tmp_path / "ready"
    script = textwrap.dedent(
        f"""
        import signal, time, torch, ckptvault as cv
        torch.manual_seed(0)
        model = torch.nn.Linear(32, 32)
        with cv.CheckpointManager({str(store)!r}, run_id="r", async_save=True,
                                  save_on_signal=(signal.SIGTERM,),
                                  preemption_deadline_s=60) as mgr:
            step = 0
            while True:
                step += 1
                with torch.no_grad():
                    model.weight.add_(1.0)
                mgr.save(step, {{"model": model, "meta": {{"step": step}}}})
                if step == 3:
                    open({str(ready)!r}, "w").close()
                time.sleep(0.02)
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)
    child.send_signal(signal.SIGTERM)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == PREEMPTED, stderr[-2000:]
    assert "preempted by SIGTERM: saved step" in stderr
    assert "Traceback" not in stderr
    final = int(stderr.split("saved step ")[1].split()[0])
    target = {"model": torch.nn.Linear(32, 32), "meta": {}}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(target)
        assert next(g.step for g in mgr.generations()) == final
    assert info is not None and info.step == final and target["meta"]["step"] == final
    # Every step added 1.0 to the weights: the final save holds the state of its step.
    torch.manual_seed(0)
    expected = torch.nn.Linear(32, 32).weight.detach()
    for _ in range(final):
        expected.add_(1.0)
    assert torch.equal(target["model"].weight, expected)


def test_the_next_save_after_the_signal_is_final_and_raises_preempted(store: Path):
    state = {"x": torch.arange(10.0)}
    previous = signal.getsignal(signal.SIGUSR1)
    with cv.CheckpointManager(
        store, run_id="r", async_save=True, save_on_signal=(signal.SIGUSR1,)
    ) as mgr:
        mgr.save(1, state)
        assert not mgr.preempted
        signal.raise_signal(signal.SIGUSR1)  # what the scheduler sends
        assert mgr.preempted
        state["x"] += 1
        with pytest.raises(cv.Preempted) as raised:
            mgr.save(2, state)
        assert raised.value.code == PREEMPTED and raised.value.step == 2
        # Synchronous: published before the exception, nothing left in flight.
        assert [g.step for g in mgr.generations()] == [2, 1]
    assert signal.getsignal(signal.SIGUSR1) == previous  # handlers put back at close
    target = {"x": torch.zeros(10)}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.restore(target)
    assert torch.equal(target["x"], torch.arange(10.0) + 1)


def test_a_save_the_deadline_cuts_short_is_not_published(store: Path, tmp_path: Path):
    keys = ControlledKeyStore(tmp_path / "keys")
    mgr = cv.CheckpointManager(
        store,
        run_id="r",
        keystore=keys,
        async_save=True,
        save_on_signal=(signal.SIGUSR1,),
        preemption_deadline_s=0.3,
    )
    try:
        mgr.save(1, {"x": torch.ones(4)}).result()
        keys.gate.clear()  # the next save hangs in the key service
        mgr.save(2, {"x": torch.ones(4)})
        signal.raise_signal(signal.SIGUSR1)
        started = time.monotonic()
        with pytest.raises(cv.Preempted) as raised:
            mgr.save(3, {"x": torch.ones(4)})
        assert raised.value.step is None  # no time was left for a final save
        assert time.monotonic() - started < 5
        assert [g.step for g in mgr.generations()] == [1]  # step 2 was not half-published
    finally:
        keys.gate.set()
        mgr.close()


def test_signal_handlers_need_the_main_thread(store: Path):
    errors: list[BaseException] = []

    def create() -> None:
        try:
            cv.CheckpointManager(store, run_id="r", save_on_signal=(signal.SIGUSR1,))
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=create)
    thread.start()
    thread.join()
    assert len(errors) == 1 and isinstance(errors[0], UsageError)
    assert "main thread" in str(errors[0])


def test_a_deadline_without_a_signal_is_a_usage_error(store: Path):
    with pytest.raises(UsageError, match="save_on_signal"):
        cv.CheckpointManager(store, run_id="r", preemption_deadline_s=30)
    with pytest.raises(UsageError, match="deadline"):
        cv.CheckpointManager(
            store, run_id="r", save_on_signal=(signal.SIGUSR1,), preemption_deadline_s=0
        )
