"""One rank of a 2-rank job whose rank 1 runs on a host with almost no memory left
(``launch(worker=...)``).

``python staging_worker.py small_host STORE OUT``: rank 1's ``/proc/meminfo`` is a
file saying 1 MiB is available. Both ranks ask for an asynchronous save of 8 MiB,
twice: every rank must refuse together (rank 1 with its own figures, rank 0 saying
another rank's host cannot hold its slots), nothing published. A synchronous save
then goes through on both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

import ckptvault as cv
from ckptvault.io import memory_available
from support.dcp_worker import run_scenario

RANK = int(os.environ.get("RANK", "0"))


def small_host(store: str, out: dict[str, Any]) -> None:
    if RANK == 1:
        meminfo = Path(store).parent / "meminfo-rank1"
        meminfo.write_text("MemTotal:  65536 kB\nMemAvailable:  1024 kB\n")
        memory_available.MEMINFO = meminfo
        memory_available.SELF_CGROUP = Path(store).parent / "no-cgroup"
    state = {"w": torch.ones(2 * 1024 * 1024)}  # 8 MiB
    refusals = []
    with cv.CheckpointManager(store, run_id="job", catalog=False, collective_timeout_s=20) as mgr:
        for step in (1, 2):  # refused twice, together: the ranks keep asking together
            try:
                mgr.save(step, state, blocking=False).result()
                refusals.append(None)
            except cv.errors.HostMemoryError as exc:
                refusals.append([exc.reason, exc.needed, str(exc)])
        mgr.save(3, state, blocking=True)
        out["generations"] = [g.step for g in mgr.generations()]
    out["refusals"] = refusals


SCENARIOS = {"small_host": small_host}


if __name__ == "__main__":
    run_scenario(SCENARIOS)
