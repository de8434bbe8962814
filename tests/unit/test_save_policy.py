"""Save policies: ``mgr.should_save(step)`` by ``cv.Every``, ``cv.Planned`` and ``cv.Any``.

Schedules are told the time, so these tests drive them with explicit clock values
and never sleep or assert timings. Agreement between ranks is tested on real gloo
ranks in tests/distributed/test_save_policy_ranks.py.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.coordinator import SingleProcess
from ckptvault.errors import UsageError
from ckptvault.observe.catalog import Catalog
from ckptvault.planning.cadence import daly_interval
from ckptvault.saving.decider import SaveDecider
from ckptvault.saving.policy import ASSUMED_SAVE_S


def _steps_due(schedule, steps, now=0.0):
    return [s for s in steps if schedule.due(s, now)]


def test_every_steps_saves_the_same_steps_after_a_resume():
    schedule = cv.Every(steps=3).schedule(now=0.0)
    assert _steps_due(schedule, range(1, 10)) == [3, 6, 9]
    resumed = cv.Every(steps=3).schedule(now=500.0)  # a restart: same steps, any clock
    assert _steps_due(resumed, range(7, 13), now=900.0) == [9, 12]
    assert not cv.Every(steps=3).uses_clock


def test_every_seconds_counts_from_the_start_of_the_last_save():
    schedule = cv.Every(seconds=10).schedule(now=100.0)
    assert not schedule.due(1, 109.9)
    assert schedule.due(1, 110.0)
    assert schedule.due(2, 111.0)  # still due until something is saved
    schedule.saved(2, now=115.0, cost_s=4.0)  # the save began at 111
    assert not schedule.due(3, 120.9)
    assert schedule.due(3, 121.0)
    assert cv.Every(seconds=10).uses_clock


def test_any_saves_when_either_rule_does_and_a_save_restarts_every_clock():
    policy = cv.Any(cv.Every(steps=100), cv.Every(seconds=60))
    assert policy.uses_clock
    schedule = policy.schedule(now=0.0)
    assert schedule.due(100, 1.0)  # the step rule
    schedule.saved(100, now=2.0, cost_s=1.0)
    assert not schedule.due(101, 60.0)  # the time rule's clock restarted at 1.0
    assert schedule.due(102, 61.0)  # the time rule
    assert not cv.Any(cv.Every(steps=5)).uses_clock


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: cv.Every(500), "cv.Every(steps=500)"),
        (lambda: cv.Every(), "one of steps= or seconds="),
        (lambda: cv.Every(steps=10, seconds=5), "cv.Any("),
        (lambda: cv.Every(steps=0), "steps=0 is not a whole number of at least 1"),
        (lambda: cv.Every(steps=2.5), "steps=2.5 is not a whole number"),
        (lambda: cv.Every(steps=True), "steps=True is not a whole number"),
        (lambda: cv.Every(seconds=-1), "seconds=-1 is not a finite number above zero"),
        (lambda: cv.Every(seconds=float("inf")), "seconds=inf"),
        (lambda: cv.Planned(mtbf_hours=0, nodes=4), "mtbf_hours=0 is not a finite number"),
        (lambda: cv.Planned(mtbf_hours="10", nodes=4), "mtbf_hours='10'"),
        (lambda: cv.Planned(mtbf_hours=10, nodes=0), "nodes=0 is not a whole number"),
        (lambda: cv.Any(), "at least one policy"),
        (lambda: cv.Any(cv.Every(steps=5), 100), "policy 2 is 100, not a save policy"),
        (lambda: cv.Any(cv.Every), "not a save policy"),
    ],
)
def test_bad_arguments_are_usage_errors_that_say_what_to_give(make, words):
    with pytest.raises(UsageError) as raised:
        make()
    assert words in str(raised.value)
    assert "give" in str(raised.value) or "cv.Every(steps=500)" in str(raised.value)


def test_planned_uses_dalys_interval_and_logs_each_change(caplog):
    policy = cv.Planned(mtbf_hours=10, nodes=5)  # the job fails every 2 h
    mtbf = 2 * 3600.0
    assert policy.job_mtbf_s == mtbf
    with caplog.at_level(logging.INFO, logger="ckptvault"):
        schedule = policy.schedule(now=0.0)
        first = daly_interval(ASSUMED_SAVE_S, mtbf)  # nothing measured yet
        assert schedule.interval_s == pytest.approx(first)
        assert "no save measured yet" in caplog.text
        assert not schedule.due(1, first - 1) and schedule.due(1, first)
        caplog.clear()

        schedule.saved(1, now=first + 20.0, cost_s=20.0)  # a save costs 20 s
        assert schedule.interval_s == pytest.approx(daly_interval(20.0, mtbf))
        (line,) = [r.getMessage() for r in caplog.records]
        assert f"{first:.4g} s -> {daly_interval(20.0, mtbf):.4g} s" in line
        assert "a save costs 20 s" in line and "Planned(mtbf_hours=10, nodes=5)" in line
        # Counted from the end of the save (Daly's tau): work between saves.
        assert not schedule.due(2, first + 20.0 + schedule.interval_s - 1)
        caplog.clear()

        schedule.saved(2, now=10_000.0, cost_s=21.0)  # jitter: the interval stays
        assert schedule.interval_s == pytest.approx(daly_interval(20.0, mtbf))
        assert caplog.records == []

        for step in (3, 4, 5):  # saves got much cheaper: the median follows
            schedule.saved(step, now=20_000.0 + step, cost_s=2.0)
        assert schedule.interval_s == pytest.approx(daly_interval(2.0, mtbf))
        assert any(" -> " in r.getMessage() for r in caplog.records)


def test_planned_starts_from_the_costs_measured_before_a_restart(caplog):
    with caplog.at_level(logging.INFO, logger="ckptvault"):
        schedule = cv.Planned(mtbf_hours=8).schedule(now=0.0, measured_costs=[4.0, 5.0, 100.0])
    assert schedule.interval_s == pytest.approx(daly_interval(5.0, 8 * 3600.0))
    assert "before this process" in caplog.text


def test_should_save_follows_the_policy_and_the_saves(store: Path):
    state = {"x": torch.ones(3)}
    with cv.CheckpointManager(store, run_id="r", save_policy=cv.Every(steps=2)) as mgr:
        assert mgr.save_policy == cv.Every(steps=2)
        saved = []
        for step in range(1, 6):
            if mgr.should_save(step):
                mgr.save(step, state)
                saved.append(step)
        assert saved == [2, 4]
        assert sorted(g.step for g in mgr.generations()) == [2, 4]


def test_a_manager_feeds_its_measured_save_cost_to_planned(store: Path):
    ticks = iter(float(t) for t in range(0, 10_000, 1))
    with cv.CheckpointManager(store, run_id="r", catalog=False) as mgr:
        decider = SaveDecider(cv.Planned(mtbf_hours=1), SingleProcess(), clock=lambda: next(ticks))
        mgr._decider = decider  # the same decider save_policy= builds, on a fake clock
        schedule = decider._schedule
        mgr.save(1, {"x": torch.ones(3)})
        assert len(schedule.costs) == 1 and schedule.costs[0] == pytest.approx(
            mgr.stats.last_stall_seconds
        )


def test_should_save_without_a_policy_and_a_bad_policy_are_usage_errors(store: Path):
    with cv.CheckpointManager(store, run_id="r") as mgr, pytest.raises(UsageError) as raised:
        mgr.should_save(1)
    assert "save_policy=cv.Every(steps=N)" in str(raised.value)
    with pytest.raises(UsageError, match="save_policy= is 500, not a save policy"):
        cv.CheckpointManager(store, run_id="r", save_policy=500)
    policy = cv.Every(steps=2)
    with (
        cv.CheckpointManager(store, run_id="r", save_policy=policy) as mgr,
        pytest.raises(UsageError, match="step must be an int"),
    ):
        mgr.should_save(-1)


def test_a_preemption_signal_makes_should_save_true_and_the_save_final(store: Path):
    previous = signal.getsignal(signal.SIGUSR1)
    state = {"x": torch.arange(4.0)}
    with cv.CheckpointManager(
        store,
        run_id="r",
        save_policy=cv.Every(steps=1000),
        save_on_signal=(signal.SIGUSR1,),
    ) as mgr:
        assert not mgr.should_save(7)
        signal.raise_signal(signal.SIGUSR1)  # what the scheduler sends
        assert mgr.should_save(7)  # not a step the policy would save
        with pytest.raises(cv.Preempted) as raised:
            mgr.save(7, state)
        assert raised.value.step == 7
        assert [g.step for g in mgr.generations()] == [7]
    assert signal.getsignal(signal.SIGUSR1) == previous


def test_a_restarted_run_plans_with_the_catalogs_save_costs(tmp_path: Path, caplog):
    store, catalog = tmp_path / "store", tmp_path / "catalog.sqlite3"
    with cv.CheckpointManager(store, run_id="r", catalog=catalog) as mgr:
        mgr.save(1, {"x": torch.ones(3)})
    with Catalog(catalog) as records:
        (record,) = records.recent_saves(run_id="r")
    with (
        caplog.at_level(logging.INFO, logger="ckptvault"),
        cv.CheckpointManager(
            store, run_id="r", catalog=catalog, save_policy=cv.Planned(mtbf_hours=1)
        ) as mgr,
    ):
        interval = mgr._decider._schedule.interval_s
    assert interval == pytest.approx(daly_interval(record.stall_seconds, 3600.0))
    assert "median of the newest 1 saves of this run before this process" in caplog.text
