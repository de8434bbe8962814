"""One rank of a 2-rank job asking ``mgr.should_save(step)`` (``launch(worker=...)``).

``python save_policy_worker.py SCENARIO STORE OUT`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT in the environment; writes what it saw to
``OUT/rank<r>.json``. The ranks' clocks and step times differ on purpose: rank 0
starts its steps 1.2 s late, rank 1 takes longer per step.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

import ckptvault as cv
from support.dcp_worker import run_scenario

RANK = int(os.environ.get("RANK", "0"))
RUN = "policy-job"
STEPS = 8


def agree(store: str, out: dict[str, Any]) -> None:
    """A step rule and a time rule: every rank gets the same answers, and the time
    rule's answer is rank 0's even where this rank's own clock would say otherwise."""
    policy = cv.Any(cv.Every(steps=4), cv.Every(seconds=1.0))
    with cv.CheckpointManager(store, run_id=RUN, save_policy=policy, catalog=False) as mgr:
        own = policy.schedule(time.monotonic())  # what this rank's clock alone would say
        if RANK == 0:
            time.sleep(1.2)  # rank 0's clock is past the time rule before step 1
        decisions, alone = [], []
        for step in range(1, STEPS + 1):
            if RANK == 1:
                time.sleep(0.02)  # a slower step on rank 1
            alone.append(own.due(step, time.monotonic()))
            decision = mgr.should_save(step)
            decisions.append(decision)
            if decision:
                handle = mgr.save(step, {"x": torch.full((4,), float(step))})
                own.saved(step, time.monotonic(), handle.stall_seconds)
        out["decisions"] = decisions
        out["alone"] = alone
        out["generations"] = sorted(g.step for g in mgr.generations())


def dishonest(store: str, out: dict[str, Any]) -> None:
    """Rank 0 answers with something that is not true or false: every rank refuses it."""
    policy = cv.Every(seconds=1000.0)
    with cv.CheckpointManager(store, run_id=RUN, save_policy=policy, catalog=False) as mgr:
        if RANK == 0:
            schedule: Any = mgr._decider._schedule  # type: ignore[union-attr]
            schedule.due = lambda step, now: "yes"
        try:
            mgr.should_save(1)
        except cv.errors.CheckpointError as exc:
            out["error"] = [type(exc).__name__, str(exc)]


SCENARIOS = {"agree": agree, "dishonest": dishonest}


if __name__ == "__main__":
    run_scenario(SCENARIOS)
