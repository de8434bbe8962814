"""The demo's supervised phase: the training job under ``ckptvault supervise``,
preempted (SIGTERM: a final save, exit 75) and killed (SIGKILL) along the way, ends
bit-identical to the uninterrupted reference, and the catalog shows every attempt."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
# (signal, the step at which it is sent): a scheduler's preemption, a node failure, ...
INTERRUPTIONS = [(signal.SIGTERM, 0.2), (signal.SIGKILL, 0.45), (signal.SIGTERM, 0.7)]


def supervised_run(out: Path, steps: int, save_every: int, batch: int = 64) -> dict:
    """Run the job under the supervisor, interrupt it, and report what happened."""
    store, catalog = out / "supervised", out / "catalog.sqlite3"
    command = [
        sys.executable, "-m", "ckptvault", "supervise",
        "--max-restarts", "3", "--backoff", "0.5",
        "--store", str(store), "--done-file", str(out / "done.json"),
        "--expect-tokens", str(steps * batch),
        "--catalog", str(catalog), "--log", str(out / "supervise.jsonl"),
        "--",
        sys.executable, str(HERE / "train.py"), str(store),
        "--steps", str(steps), "--save-every", str(save_every), "--async-save", "--preemptible",
    ]  # fmt: skip
    with open(out / "supervise.log", "w") as log:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True)
        assert process.stdout is not None
        pending = [(sig, int(steps * at)) for sig, at in INTERRUPTIONS]
        sent, pid, done = [], None, None
        for line in process.stdout:
            event = json.loads(line)
            if event["event"] == "restored":
                pid = event["pid"]
            elif event["event"] == "done":
                done = event
            elif event["event"] == "step" and pending and event["step"] >= pending[0][1]:
                sig, _ = pending.pop(0)
                os.kill(pid, sig)  # the job's process, not the supervisor
                sent.append((sig.name, event["step"]))
        returncode = process.wait()
    listing = subprocess.run(
        [sys.executable, "-m", "ckptvault", "catalog", "--catalog", str(catalog), "--json"],
        capture_output=True,
        text=True,
    )
    attempts = json.loads(listing.stdout)["attempts"] if listing.returncode == 0 else []
    return {"returncode": returncode, "done": done, "sent": sent, "attempts": attempts}
