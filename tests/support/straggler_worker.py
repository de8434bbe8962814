"""One rank of a 2-rank job whose rank 1 is slow (``launch(worker=...)``).

``python straggler_worker.py stragglers STORE OUT``: each rank heartbeats ten
steps (rank 1 sleeping longer per step); the tenth call gathers the step times on
rank 0. Then rank 1 lies about its step time at the next exchange (the 25th call).
Rank 0 reports the straggler gauges it exposes after each exchange; every rank saves
and reports its progress file and the bytes its saves wrote.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import ckptvault as cv
from ckptvault.observe.heartbeat import read_progress
from support.dcp_worker import run_scenario

RANK = int(os.environ.get("RANK", "0"))
SLEEP_S = {0: 0.005, 1: 0.06}  # rank 1 is the straggler


def gauges(mgr: cv.CheckpointManager) -> dict[str, dict[str, float]]:
    """``{metric: {rank: value}}`` of the step-time gauges rank 0 exposes."""
    text = generate_latest(mgr.metrics_registry).decode()
    seen: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("ckptvault_straggler", "ckptvault_rank_step_seconds"):
                seen.setdefault(sample.name, {})[sample.labels["rank"]] = sample.value
    return seen


def stragglers(store: str, out: dict[str, Any]) -> None:
    state = {"w": torch.ones(4)}
    with cv.CheckpointManager(store, run_id="job", collective_timeout_s=20) as mgr:
        for step in range(1, 11):  # the 10th call exchanges
            time.sleep(SLEEP_S[RANK])
            mgr.heartbeat(step)
        if RANK == 0:
            out["after_exchange"] = gauges(mgr)
        mgr.save(10, state)
        if RANK == 1:  # a peer that sends nonsense: rank 0 refuses it and carries on
            mgr._progress.clock.recent = lambda: -5.0  # type: ignore[method-assign]
        for step in range(11, 26):  # the 25th call exchanges
            mgr.heartbeat(step)
        if RANK == 0:
            out["after_lie"] = gauges(mgr)
        if RANK == 1:  # the lie told, the rank's own figure is back (its progress file too)
            del mgr._progress.clock.recent
        mgr.save(25, state)
        out["saved"] = [g.step for g in mgr.generations()]
        progress = read_progress(mgr._progress.writer.path)
        out["progress"] = [progress.rank, progress.phase, progress.step]
        out["saved_bytes"] = mgr._progress.saved_bytes  # the collective save's writes


SCENARIOS = {"stragglers": stragglers}

if __name__ == "__main__":
    run_scenario(SCENARIOS)
