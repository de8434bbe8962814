"""Stragglers: a real 2-rank gloo job with rank 1 slowed; rank 0's metrics mark it,
and not rank 0. Step times cross ranks as tiny checked JSON: a rank that lies about
its own is refused on rank 0, and the job goes on."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckptvault.observe.stragglers import StepClock, find_stragglers
from support.multirank import launch

WORKER = Path(__file__).resolve().parents[1] / "support" / "straggler_worker.py"


def test_the_slowed_rank_is_marked_a_straggler(tmp_path: Path) -> None:
    codes, reports = launch("stragglers", tmp_path / "store", 2, tmp_path / "out", worker=WORKER)
    assert codes == [0, 0], [r.get("log", "")[-2000:] for r in reports]
    first = reports[0]["after_exchange"]
    assert first["ckptvault_straggler"] == {"0": 0.0, "1": 1.0}
    step = first["ckptvault_rank_step_seconds"]
    assert step["1"] > step["0"]
    # Rank 1 then sent a negative step time: refused, the last good figures stay.
    assert reports[0]["after_lie"] == first
    assert "rank 1 sent a step time -5.0 out of range" in reports[0]["log"]
    assert all(r["saved"] == [25, 10] for r in reports)
    # Each rank's own record, back in training after the save; the collective save
    # told its writes (the tiny state is written by one rank).
    assert [r["progress"] for r in reports] == [[0, "training", 25], [1, "training", 25]]
    assert sum(r["saved_bytes"] for r in reports) > 0


def test_the_step_clock_leaves_out_waits_repeats_and_restores() -> None:
    clock = StepClock()
    clock.beat(0, now=0.0)
    clock.beat(0, now=0.5)  # should_save and save of one step: measured once
    clock.waited(3.0)  # in an exchange, waiting for a slow peer
    clock.beat(2, now=5.0)  # two steps in 5 s, 3 s of which waiting: 1 s a step
    assert clock.recent() == pytest.approx(1.0)
    clock.beat(1, now=6.0)  # a restore went back: starts measuring again
    assert clock.recent() == pytest.approx(1.0)
    clock.beat(2, now=6.5, step_seconds=0.25)  # the rank's own figure wins from now on
    clock.beat(3, now=9.5)
    assert clock.recent() == pytest.approx(0.625)  # median of 1.0 and 0.25


def test_find_stragglers_against_the_median() -> None:
    assert find_stragglers({0: 1.0, 1: 1.1, 2: 1.0, 3: 2.0}) == {3}
    assert find_stragglers({0: 1.0, 1: 1.0}) == set()
    assert find_stragglers({}) == set()
