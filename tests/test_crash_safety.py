"""Crash safety: SIGKILL a save loop at random moments; every time, a fresh process
restores at least the last step whose save() had returned, and verify passes.

CI runs a bounded number of kills; ``make crash`` (CKPTVAULT_CRASH_KILLS=200) runs
a long budget. The random seed is printed so a failure can be replayed with
CKPTVAULT_CRASH_SEED.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import run_cli

WORKER = Path(__file__).with_name("crash_worker.py")


class Worker:
    def __init__(self, store: Path) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(WORKER), str(store)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self.first_save = threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line.strip())
            if line.startswith("saved"):
                self.first_save.set()

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        self._reader.join(timeout=30)

    def restored(self) -> int:
        assert self.lines and self.lines[0].startswith("restored"), (
            self.lines,
            self.process.stderr.read() if self.process.poll() is not None else "",
        )
        return int(self.lines[0].split()[1])

    def last_saved(self) -> int:
        saved = [int(line.split()[1]) for line in self.lines if line.startswith("saved")]
        return max(saved, default=-1)


def test_sigkill_during_saves_never_loses_a_returned_save(tmp_path: Path):
    kills = int(os.environ.get("CKPTVAULT_CRASH_KILLS", "8"))
    seed = int(os.environ.get("CKPTVAULT_CRASH_SEED", str(time.time_ns() % 2**32)))
    print(f"crash test: {kills} kills, seed {seed}")
    rng = random.Random(seed)
    store = tmp_path / "store"
    durable = -1  # the last step whose save() returned, over all runs
    mid_save_kills = 0
    for attempt in range(kills):
        worker = Worker(store)
        assert worker.first_save.wait(timeout=120), (
            f"worker never saved: {worker.process.stderr.read()}"
        )
        assert worker.restored() >= durable, (
            f"kill {attempt}: restored {worker.restored()} < {durable}"
        )
        time.sleep(rng.uniform(0.0, 0.8))
        worker.kill()
        durable = max(durable, worker.last_saved())
        staging = store / ".staging"
        if staging.exists() and os.listdir(staging):
            mid_save_kills += 1
        result = run_cli("verify", str(store), "--all")
        assert result.returncode == 0, (
            f"kill {attempt} (seed {seed}): {result.stdout}{result.stderr}"
        )
    final = Worker(store)
    assert final.first_save.wait(timeout=120)
    assert final.restored() >= durable
    final.kill()
    assert durable > 0
    print(f"{mid_save_kills} of {kills} kills left a save in progress; last durable step {durable}")
    # The kills really landed while saves were in progress (staging areas left behind).
    assert mid_save_kills >= max(1, kills // 4), (
        f"only {mid_save_kills} of {kills} kills hit a save"
    )
