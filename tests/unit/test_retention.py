"""Retention rules and the retention planner as units: no store, no files, no torch."""

from __future__ import annotations

import dataclasses
from datetime import datetime, timedelta, timezone

import pytest

import ckptvault as cv
from ckptvault.errors import UsageError
from ckptvault.format.layout import GenerationName, new_generation_id
from ckptvault.retention.plan import (
    ABANDONED,
    DELETE,
    DROPPED,
    FALLBACK,
    FLOOR,
    GONE,
    IN_FLIGHT,
    KEEP,
    MARK,
    MARKED,
    NEWER_THAN_VERIFIED,
    NEWEST_VERIFIED,
    NO_RULES,
    PINNED,
    UNMARK,
    GenerationFacts,
    Mark,
    OrphanMark,
    RetentionPlan,
    plan_retention,
)
from ckptvault.retention.policy import (
    KeepBest,
    KeepCalendar,
    KeepEvery,
    KeepLast,
    KeepWithin,
    Retention,
    RuleInput,
    format_seconds,
)
from ckptvault.trust.ledger import RestoreFloor, RollbackRule

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=timezone.utc)  # a Monday


def gen(
    step: int,
    created: datetime | None = None,
    *,
    verified: bool | None = True,
    metrics: dict[str, float] | None = None,
    mark: Mark | None = None,
    pinned: bool = False,
    leases: tuple[datetime, ...] = (),
) -> GenerationFacts:
    created = created or NOW - timedelta(minutes=1000 - step)
    return GenerationFacts(
        name=GenerationName(step, new_generation_id(created)),
        created=created,
        metrics=metrics,
        mark=mark,
        pinned=pinned,
        lease_expiries=leases,
        verified=verified,
    )


def plan(gens: list[GenerationFacts], retention: Retention | None = None, **kw) -> RetentionPlan:
    retention = retention or Retention(keep_last=1, delete_delay=0)
    kw.setdefault("now", NOW)
    return plan_retention(gens, rules=retention.rules, delete_delay=retention.delete_delay, **kw)


def actions(p: RetentionPlan) -> dict[int, str]:
    return {d.step: d.action for d in p.decisions if d.listed}


def reasons(p: RetentionPlan, step: int) -> tuple[str, ...]:
    return next(d.reasons for d in p.decisions if d.step == step and d.listed)


def inputs(gens: list[GenerationFacts]) -> list[RuleInput]:
    ordered = sorted(gens, key=lambda g: g.name, reverse=True)
    return [RuleInput(g.name, g.created, g.metrics) for g in ordered]


def kept_steps(rule, gens: list[GenerationFacts], now: datetime = NOW) -> list[int]:
    return sorted((name.step for name in rule.keeps(inputs(gens), now)), reverse=True)


# -- the policy object ------------------------------------------------------------------


def test_retention_is_a_frozen_validated_public_dataclass():
    policy = cv.Retention(keep_last=2, keep_every=1000, delete_delay=0)
    assert isinstance(policy, Retention) and "Retention" in cv.__all__
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.keep_last = 3  # type: ignore[misc]
    assert policy == cv.Retention(keep_last=2, keep_every=1000, delete_delay=0)
    assert [type(rule) for rule in policy.rules] == [KeepLast, KeepEvery]
    assert policy.describe() == "keep_last=2, keep_every=1000, delete_delay=0s"
    # The default delay: none for keep_last alone (space back at the next save, as
    # save_total_limit and max_to_keep), a day for any policy with another rule.
    assert cv.Retention(keep_last=1).delete_delay == 0
    assert cv.Retention(keep_last=1, delete_delay="auto").delete_delay == 0
    assert cv.Retention(keep_last=1, keep_every=10).delete_delay == 86400
    assert cv.Retention(keep_best=1, metric="loss").delete_delay == 86400
    assert cv.Retention(keep_last=1, delete_delay=3600).delete_delay == 3600
    full = cv.Retention(
        keep_last=3,
        keep_every=1000,
        keep_best=2,
        metric="val_loss",
        mode="max",
        keep_within=7200,
        keep_hourly=24,
        keep_daily=7,
        keep_weekly=4,
    )
    assert [type(rule) for rule in full.rules] == [
        KeepLast,
        KeepEvery,
        KeepBest,
        KeepWithin,
        KeepCalendar,
        KeepCalendar,
        KeepCalendar,
    ]
    assert "keep_within=2h" in full.describe() and "metric=val_loss, mode=max" in full.describe()


@pytest.mark.parametrize(
    "options, fragment",
    [
        ({}, "at least one rule"),
        ({"delete_delay": 0}, "at least one rule"),
        ({"keep_last": 0}, "keep_last"),
        ({"keep_last": -1}, "keep_last"),
        ({"keep_last": True}, "keep_last"),
        ({"keep_last": 2.0}, "keep_last"),
        ({"keep_every": 0}, "keep_every"),
        ({"keep_daily": "7"}, "keep_daily"),
        ({"keep_best": 2}, "needs metric"),
        ({"keep_best": 2, "metric": "val loss"}, "metric"),
        ({"keep_last": 1, "metric": "val_loss"}, "only with keep_best"),
        ({"keep_best": 1, "metric": "acc", "mode": "best"}, "mode"),
        ({"keep_within": 0}, "keep_within"),
        ({"keep_last": 1, "delete_delay": -1}, "delete_delay"),
        ({"keep_last": 1, "delete_delay": float("nan")}, "delete_delay"),
        ({"keep_last": 1, "delete_delay": None}, "delete_delay"),
        ({"keep_within": 1e12}, "at most a thousand years"),  # past datetime's range
        ({"keep_last": 1, "delete_delay": 1e12}, "at most a thousand years"),
    ],
)
def test_retention_refuses_bad_options(options, fragment):
    with pytest.raises(UsageError, match=fragment):
        Retention(**options)


def test_format_seconds():
    assert [format_seconds(s) for s in (0, 90, 1800, 86400, 3 * 3600, 7 * 86400, 1.5)] == [
        "0s",
        "90s",
        "30m",
        "1d",
        "3h",
        "7d",
        "1.5s",
    ]


# -- each rule alone ----------------------------------------------------------------------


def test_keep_last_keeps_the_newest_by_step():
    gens = [gen(s) for s in (10, 20, 30, 40)]
    assert kept_steps(KeepLast(2), gens) == [40, 30]
    assert kept_steps(KeepLast(9), gens) == [40, 30, 20, 10]
    assert set(KeepLast(2).keeps(inputs(gens), NOW).values()) == {"keep_last=2"}


def test_keep_every_keeps_multiples_of_the_step():
    gens = [gen(s) for s in (0, 500, 1000, 1500, 2000, 2001)]
    assert kept_steps(KeepEvery(1000), gens) == [2000, 1000, 0]


def test_keep_best_min_and_max_ignore_generations_without_the_metric():
    gens = [
        gen(1, metrics={"val_loss": 0.9, "acc": 0.1}),
        gen(2, metrics={"val_loss": 0.3}),
        gen(3),  # recorded nothing
        gen(4, metrics={"acc": 0.9}),  # recorded another metric
        gen(5, metrics={"val_loss": 0.5, "acc": 0.5}),
    ]
    assert kept_steps(KeepBest(2, "val_loss", "min"), gens) == [5, 2]
    assert kept_steps(KeepBest(1, "val_loss", "max"), gens) == [1]
    assert kept_steps(KeepBest(5, "val_loss", "min"), gens) == [5, 2, 1]  # only three recorded
    assert kept_steps(KeepBest(2, "acc", "max"), gens) == [5, 4]
    assert kept_steps(KeepBest(2, "perplexity", "min"), gens) == []
    reason = KeepBest(1, "val_loss", "min").keeps(inputs(gens), NOW)
    assert list(reason.values()) == ["keep_best=1 (val_loss=0.3, min)"]


def test_keep_best_ties_go_to_the_newer_generation():
    gens = [gen(s, metrics={"loss": 1.0}) for s in (1, 2, 3)]
    assert kept_steps(KeepBest(2, "loss"), gens) == [3, 2]


def test_keep_within_keeps_recent_creation_times():
    gens = [
        gen(1, NOW - timedelta(hours=5)),
        gen(2, NOW - timedelta(hours=2)),
        gen(3, NOW - timedelta(hours=1)),
        gen(4, NOW - timedelta(seconds=10)),
    ]
    assert kept_steps(KeepWithin(2 * 3600), gens) == [4, 3, 2]  # 2 h ago is still within
    assert kept_steps(KeepWithin(60), gens) == [4]


def test_calendar_rules_keep_the_newest_of_each_recent_period_that_has_one():
    at = datetime(2026, 11, 30, 10, 0, tzinfo=timezone.utc)
    gens = [
        gen(1, at + timedelta(minutes=5)),
        gen(2, at + timedelta(minutes=50)),  # newest of 10:00
        gen(3, at + timedelta(hours=1, minutes=10)),  # only one of 11:00
        # no generation at 12:00 or 13:00: those hours do not count
        gen(4, at + timedelta(hours=4, minutes=1)),
        gen(5, at + timedelta(hours=4, minutes=30)),  # newest of 14:00
    ]
    now = at + timedelta(hours=5)
    assert kept_steps(KeepCalendar("hourly", 2), gens, now) == [5, 3]
    assert kept_steps(KeepCalendar("hourly", 3), gens, now) == [5, 3, 2]
    assert kept_steps(KeepCalendar("hourly", 10), gens, now) == [5, 3, 2]
    assert kept_steps(KeepCalendar("daily", 5), gens, now) == [5]
    reasons_ = KeepCalendar("hourly", 2).keeps(inputs(gens), now)
    assert sorted(reasons_.values()) == [
        "keep_hourly=2 (2026-11-30T11)",
        "keep_hourly=2 (2026-11-30T14)",
    ]


def test_calendar_uses_creation_time_not_step_and_iso_weeks():
    # 2026-12-27 is a Sunday in ISO week 52; 2026-12-28 a Monday in week 53.
    sunday = datetime(2026, 12, 27, 23, 0, tzinfo=timezone.utc)
    gens = [
        gen(100, sunday - timedelta(days=6)),  # Monday of week 52
        gen(50, sunday),  # a smaller step saved later (after a rollback): newest of week 52
        gen(200, sunday + timedelta(hours=2)),  # week 53
    ]
    assert kept_steps(KeepCalendar("weekly", 2), gens, sunday + timedelta(days=1)) == [200, 50]
    daily = KeepCalendar("daily", 3).keeps(inputs(gens), sunday + timedelta(days=1))
    assert sorted(daily.values()) == [
        "keep_daily=3 (2026-12-21)",
        "keep_daily=3 (2026-12-27)",
        "keep_daily=3 (2026-12-28)",
    ]


def test_the_seed_pyramid_over_ten_days_of_saves():
    """Last 3, hourly for a day, daily for a week, every 1000th step for ever."""
    start = NOW - timedelta(days=10)
    gens = [gen(step, start + timedelta(minutes=10 * step)) for step in range(0, 10 * 144)]
    policy = Retention(keep_last=3, keep_hourly=24, keep_daily=7, keep_every=1000, delete_delay=0)
    p = plan(gens, policy)
    kept = {d.step for d in p.decisions if d.action == KEEP}

    by_time = sorted(gens, key=lambda g: g.created, reverse=True)
    newest_per_hour: dict[str, int] = {}
    newest_per_day: dict[str, int] = {}
    for g in by_time:
        newest_per_hour.setdefault(g.created.strftime("%Y%m%d%H"), g.step)
        newest_per_day.setdefault(g.created.strftime("%Y%m%d"), g.step)
    expected = {g.step for g in by_time[:3]}
    expected |= set(list(newest_per_hour.values())[:24])
    expected |= set(list(newest_per_day.values())[:7])
    expected |= {g.step for g in gens if g.step % 1000 == 0}
    assert kept == expected
    # 24 hourly (which cover today's and yesterday's daily), 2 more of the last 3, the 5
    # older days, and the milestones 0 and 1000.
    assert len(kept) == 24 + 2 + 5 + 2
    assert {0, 1000} <= kept  # milestones survive ten days
    # Every kept generation says which rules kept it; everything else goes.
    newest = max(g.step for g in gens)
    assert reasons(p, newest) == (
        NEWEST_VERIFIED,
        "keep_last=3",
        f"keep_hourly=24 ({by_time[0].created:%Y-%m-%dT%H})",
        f"keep_daily=7 ({by_time[0].created:%Y-%m-%d})",
    )
    assert reasons(p, 1000) == ("keep_every=1000",)
    assert all(d.action == DELETE and d.reasons == (DROPPED,) for d in p.decisions if d.step == 5)
    assert len(p.having(DELETE)) == len(gens) - len(kept)


# -- composition and the always-kept set ------------------------------------------------------


def test_rules_compose_by_union_and_name_every_rule_that_kept():
    gens = [gen(s, metrics={"loss": 10 - s}) for s in range(1, 9)]
    policy = Retention(keep_last=2, keep_every=4, keep_best=1, metric="loss", delete_delay=0)
    p = plan(gens, policy)
    assert actions(p) == {
        8: KEEP,
        7: KEEP,
        6: DELETE,
        5: DELETE,
        4: KEEP,
        3: DELETE,
        2: DELETE,
        1: DELETE,
    }
    assert reasons(p, 8) == (
        NEWEST_VERIFIED,
        "keep_last=2",
        "keep_every=4",
        "keep_best=1 (loss=2, min)",
    )
    assert reasons(p, 7) == (FALLBACK, "keep_last=2")
    assert reasons(p, 4) == ("keep_every=4",)


def test_newest_verified_and_an_older_verified_fallback_are_always_kept():
    gens = [gen(1), gen(2), gen(3, verified=False), gen(4), gen(5, verified=None)]
    p = plan(gens, Retention(keep_every=1000, delete_delay=0))
    # 5 is unknown and newer than the newest verified: kept for a person to look at.
    assert actions(p) == {5: KEEP, 4: KEEP, 3: DELETE, 2: KEEP, 1: DELETE}
    assert reasons(p, 5) == (NEWER_THAN_VERIFIED,)
    assert reasons(p, 4) == (NEWEST_VERIFIED,)
    assert reasons(p, 2) == (FALLBACK,)  # 3 does not verify: it is no fallback
    assert (p.newest_verified.step, p.fallback.step) == (4, 2)


def test_pins_floor_in_flight_and_leases_are_kept():
    later, earlier = NOW + timedelta(hours=1), NOW - timedelta(seconds=1)
    gens = [
        gen(1, pinned=True),
        gen(2),
        gen(3, leases=(earlier, later)),
        gen(4, leases=(earlier,)),  # expired: no protection
        gen(5),
        gen(6),
        gen(7),
    ]
    floor = RestoreFloor("run", step=2, generation_id=gens[1].generation_id)
    in_flight = [gens[4].generation_id]
    p = plan(gens, Retention(keep_last=1, delete_delay=0), floor=floor, in_flight=in_flight)
    assert actions(p) == {7: KEEP, 6: KEEP, 5: KEEP, 4: DELETE, 3: KEEP, 2: KEEP, 1: KEEP}
    assert reasons(p, 1) == (PINNED,)
    assert reasons(p, 2) == (FLOOR,)
    assert reasons(p, 3) == (f"leased by a reader until {later:%Y-%m-%dT%H:%M:%S.%fZ}",)
    assert reasons(p, 5) == (IN_FLIGHT,)


def test_uncounted_generations_are_kept_and_take_no_rules_place():
    """One policy over two tiers: what is not yet copied to the replica is kept, and
    the rules choose among the copied ones (else the replica would lose them all)."""
    gens = [gen(s) for s in (1, 2, 3, 4, 5)]
    uncopied = [g.generation_id for g in gens[2:]]  # 3, 4 and 5 wait for their copies
    counted = plan(gens, Retention(keep_last=2, delete_delay=0), in_flight=uncopied)
    assert actions(counted) == {5: KEEP, 4: KEEP, 3: KEEP, 2: DELETE, 1: DELETE}
    p = plan(gens, Retention(keep_last=2, delete_delay=0), uncounted=uncopied)
    assert actions(p) == {5: KEEP, 4: KEEP, 3: KEEP, 2: KEEP, 1: KEEP}
    assert reasons(p, 2) == ("keep_last=2",) and reasons(p, 1) == ("keep_last=2",)
    assert reasons(p, 3) == (IN_FLIGHT,)


def test_nothing_goes_until_a_verified_generation_and_a_fallback_are_known():
    gens = [gen(s, verified=None) for s in (1, 2, 3)]
    p = plan(gens)
    assert actions(p) == {3: KEEP, 2: KEEP, 1: KEEP}
    assert p.blocked and p.needs_verification == gens[2].name  # verify the newest first

    gens[2] = dataclasses.replace(gens[2], verified=True)
    p = plan(gens)
    assert actions(p) == {3: KEEP, 2: KEEP, 1: KEEP}
    assert "fallback" in p.blocked and p.needs_verification == gens[1].name
    assert reasons(p, 1) == (p.blocked,)

    gens[1] = dataclasses.replace(gens[1], verified=False)  # damaged: try the next one
    assert plan(gens).needs_verification == gens[0].name
    gens[0] = dataclasses.replace(gens[0], verified=True)
    p = plan(gens)
    assert actions(p) == {3: KEEP, 2: DELETE, 1: KEEP} and p.blocked is None

    gens[0] = dataclasses.replace(gens[0], verified=False)  # no older one verifies at all
    p = plan(gens)
    assert actions(p) == {3: KEEP, 2: KEEP, 1: KEEP} and p.needs_verification is None
    assert p.blocked and "no older generation verifies" in p.blocked


def test_a_single_generation_needs_no_fallback():
    p = plan([gen(1)])
    assert actions(p) == {1: KEEP} and p.blocked is None


# -- two-phase deletion ---------------------------------------------------------------------


def test_dropped_generations_are_marked_then_deleted_after_the_delay():
    policy = Retention(keep_last=2, delete_delay=3600)
    gens = [gen(s) for s in (1, 2, 3)]
    p = plan(gens, policy)
    assert actions(p) == {3: KEEP, 2: KEEP, 1: MARK}
    marking = p.having(MARK)[0]
    assert marking.reasons == (DROPPED,) and not marking.was_marked
    assert (marking.marked_at, marking.delete_after) == (NOW, NOW + timedelta(hours=1))

    gens[0] = dataclasses.replace(gens[0], mark=Mark(NOW, DROPPED))
    waiting = plan(gens, policy, now=NOW + timedelta(minutes=59))
    assert actions(waiting) == {3: KEEP, 2: KEEP, 1: MARKED}
    assert waiting.having(MARKED)[0].delete_after == NOW + timedelta(hours=1)
    due = plan(gens, policy, now=NOW + timedelta(hours=1))
    assert actions(due) == {3: KEEP, 2: KEEP, 1: DELETE} and due.having(DELETE)[0].was_marked


def test_delay_zero_deletes_at_once():
    p = plan([gen(1), gen(2), gen(3)], Retention(keep_last=2, delete_delay=0))
    assert actions(p) == {3: KEEP, 2: KEEP, 1: DELETE}
    assert not p.having(DELETE)[0].was_marked  # the applier marks it first


def test_a_marked_generation_kept_again_is_unmarked_but_a_lease_only_defers():
    marked = Mark(NOW - timedelta(days=2), DROPPED)
    lease = (NOW + timedelta(minutes=5),)
    gens = [
        gen(1, mark=marked, pinned=True),  # pinned after it was marked
        gen(2, mark=marked),  # a wider policy keeps it again
        gen(3, mark=marked, leases=lease),  # due, but a reader holds it
        gen(4, mark=marked),  # due
        gen(5),
        gen(6),
    ]
    p = plan(gens, Retention(keep_every=2, keep_last=2, delete_delay=86400))
    assert actions(p) == {6: KEEP, 5: KEEP, 4: UNMARK, 3: MARKED, 2: UNMARK, 1: UNMARK}
    assert reasons(p, 1) == (PINNED,)
    assert reasons(p, 2) == ("keep_every=2",)
    assert reasons(p, 3)[1].startswith("leased by a reader until")
    p = plan(gens, Retention(keep_last=2, delete_delay=86400))
    assert actions(p)[4] == DELETE and actions(p)[2] == DELETE


def test_marked_generations_are_no_newest_or_fallback():
    planted = Mark(NOW, "planted")
    gens = [gen(1), gen(2), gen(3, mark=planted)]
    p = plan(gens, Retention(keep_every=1000, delete_delay=86400))
    assert (p.newest_verified, p.fallback) == (gens[1].name, gens[0].name)
    assert actions(p) == {3: MARKED, 2: KEEP, 1: KEEP}


def test_abandoned_generations_are_marked_and_not_counted_by_rules():
    gens = [gen(s) for s in (1, 2, 3, 4)]
    cutoff = new_generation_id(NOW)
    floor = RestoreFloor(
        "run", step=2, generation_id=gens[1].generation_id, rules=(RollbackRule(cutoff, 2, "x"),)
    )
    p = plan(gens, Retention(keep_last=2, delete_delay=60), floor=floor)
    assert actions(p) == {4: MARK, 3: MARK, 2: KEEP, 1: KEEP}
    assert reasons(p, 4) == (ABANDONED,)
    assert reasons(p, 2) == (NEWEST_VERIFIED, "keep_last=2", FLOOR)
    assert reasons(p, 1) == (FALLBACK, "keep_last=2")


def test_marks_of_generations_gone_from_the_store_are_finished_in_their_own_tier():
    gone = GenerationName(7, new_generation_id(NOW - timedelta(days=3)))
    orphan_mark = OrphanMark(gone, Mark(NOW - timedelta(days=3), DROPPED), "/local")
    p = plan([gen(8), gen(9)], orphan_marks=[orphan_mark])
    orphan = p.decisions[-1]
    assert (orphan.name, orphan.action, orphan.listed) == (gone, DELETE, False)
    assert orphan.reasons == (DROPPED, GONE) and orphan.was_marked
    assert orphan.only_in == ("/local",)  # never another tier's copy


def test_plan_json_names_every_decision():
    p = plan([gen(1), gen(2), gen(3)], Retention(keep_last=2, delete_delay=60))
    document = p.to_json()
    assert document["newest_verified"]["step"] == 3 and document["fallback"]["step"] == 2
    assert [d["action"] for d in document["decisions"]] == [KEEP, KEEP, MARK]
    marked = document["decisions"][2]
    assert marked["reasons"] == [DROPPED] and marked["delete_after"].endswith("Z")


def test_without_rules_only_marked_generations_go():
    old_mark = Mark(NOW - timedelta(days=2), DROPPED)
    gens = [gen(1, mark=old_mark), gen(2), gen(3), gen(4)]
    p = plan_retention(gens, rules=(), delete_delay=86400, now=NOW)
    assert actions(p) == {4: KEEP, 3: KEEP, 2: KEEP, 1: DELETE}
    assert reasons(p, 2) == (NO_RULES,)
