"""Launch a real multi-rank job of ``rank_worker.py`` processes (gloo, 127.0.0.1).

Each rank is its own process, forked from the fork server (``forkserver.py``) so
that it starts without importing torch again; ``fresh=True`` starts each with
``python`` instead.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from support.forkserver import server

WORKER = Path(__file__).with_name("rank_worker.py")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(
    scenario: str,
    store: str | Path,
    world: int,
    out: Path,
    timeout: float = 180,
    worker: Path = WORKER,
    fresh: bool = False,
) -> tuple[list[int], list[dict[str, Any]]]:
    """Run ``world`` ranks of ``scenario`` (of ``worker``, by default
    ``rank_worker.py``); their exit codes and reports (a rank that died leaves an
    empty report). ``fresh``: each rank a new interpreter rather than a fork."""
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    port = free_port()
    procs, logs = [], []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
        )
        # Output to a file, not a pipe: a rank that writes more than a pipe holds
        # would block while the launcher waits for another rank.
        log_path = out / f"rank{rank}.log"
        logs.append(log_path)
        argv = [scenario, str(store), str(out)]
        if not fresh:
            procs.append(server().start(worker, argv, env, log_path))
            continue
        with open(log_path, "w") as log:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(worker), *argv],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
    reports = []
    for rank in range(world):
        path = out / f"rank{rank}.json"
        text = logs[rank].read_text(errors="replace")
        reports.append(json.loads(path.read_text()) if path.exists() else {"log": text})
        reports[-1].setdefault("log", text[-3000:])
    return codes, reports
