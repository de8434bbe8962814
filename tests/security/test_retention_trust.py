"""Retention trusts exactly what restore trusts (issue 23, finding 1).

Whoever can write only the fast local tier copies a genuine generation of an
encrypted, unsigned run under a new generation id, gives it a metric or a time that
wins a rule's slot, and recomputes its index digests and the root's self-digest
(anyone can; no key is needed). Its manifest MAC is then wrong, so restore refuses
it (``key-unavailable``: the MAC key was wrapped for the genuine id). Before the fix
retention's structure checks never looked at the MAC: the forgery took the slot, and
the genuine generation it displaced was deleted from both tiers, the replica too,
which the attacker cannot write.

Each attack runs the same saves twice, with the forgery planted and without it: the
genuine generations each tier keeps must be the same, and the one the forgery aimed
at must survive in both tiers. Real POSIX tiers, the real replicator and keeper.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptvault as cv
from ckptvault.format.layout import (
    GenerationName,
    generation_dirname,
    new_generation_id,
    parse_generation_dirname,
)
from ckptvault.retention.plan import DELETE, MARK, GenerationFacts, plan_retention
from ckptvault.saving import generation_writer
from ckptvault.storage import open_store
from ckptvault.storage.base import GenerationRef
from ckptvault.trust.checks import check_trusted
from ckptvault.trust.problems import GenerationRejected
from support.forging import read_logical, write_logical

NOW = datetime.now(timezone.utc)
DAY = timedelta(days=1)


def weights(step: int) -> dict:
    return {"w": torch.full((16,), float(step)), "meta": {"step": step}}


@pytest.fixture
def dated_ids(monkeypatch: pytest.MonkeyPatch) -> Callable[[list[datetime]], None]:
    """Make the next saves' generation ids carry the given times, in order (a run
    that spans days, compressed into a test)."""

    def use(times: list[datetime]) -> None:
        queue: Iterator[datetime] = iter(times)

        def dated(now: datetime | None = None, not_before: str | None = None) -> str:
            return new_generation_id(next(queue, None), not_before)

        monkeypatch.setattr(generation_writer, "new_generation_id", dated)

    return use


def forge(local: Path, of_step: int, *, generation_id: str | None = None, **fields: object) -> Path:
    """A copy of the local tier's generation of ``of_step`` under a new id (and whatever
    ``fields`` say: metrics, step), its digests recomputed; the MAC left as it was."""
    genuine = next(p for p in local.iterdir() if _name(p) is not None and _name(p).step == of_step)
    document = read_logical(genuine)
    document["generation_id"] = generation_id or new_generation_id()
    document.update(fields)
    planted = local / generation_dirname(document["step"], document["generation_id"])
    shutil.copytree(genuine, planted)
    planted.chmod(0o755)
    write_logical(planted, document)
    return planted


def _name(path: Path) -> GenerationName | None:
    return parse_generation_dirname(path.name)


def assert_refused_by_restore(mgr: cv.CheckpointManager, local: Path, planted: Path) -> None:
    """The forgery is what restore refuses before it reads a tensor byte (the MAC key
    was wrapped for the genuine id): exactly what retention may not count."""
    name = _name(planted)
    assert name is not None
    ref = GenerationRef(name, str(planted))
    with pytest.raises(GenerationRejected) as refused:
        check_trusted(open_store(local), ref, mgr.trust.policy("r", None))
    assert refused.value.codes == {"key-unavailable"}


def genuine_steps(location: Path, planted: set[str]) -> list[int]:
    """The steps of the generations ``location`` lists, less the planted ones."""
    store = open_store(location)
    return sorted(
        (ref.step for ref in store.list_generations() if ref.generation_id not in planted),
        reverse=True,
    )


def run(
    tmp_path: Path,
    retention: cv.Retention,
    saves: list[tuple[int, float]],
    plant: Callable[[Path], Path] | None,
    plant_after: int,
) -> tuple[list[int], list[int], Path | None]:
    """Save ``saves`` (step, val_loss) with one policy over both tiers of an
    encrypted run; after ``plant_after`` saves, ``plant`` forges a generation in the
    local tier. The genuine steps each tier keeps, and the forgery's path."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    planted: Path | None = None
    with cv.CheckpointManager(
        local,
        run_id="r",
        keystore=tmp_path / "keys",
        ledger=tmp_path / "ledger.db",
        replicate_to=remote,
        retention=retention,
    ) as mgr:
        for done, (step, loss) in enumerate(saves):
            if done == plant_after and plant is not None:
                planted = plant(local)
                assert_refused_by_restore(mgr, local, planted)
            mgr.save(step, weights(step), metrics={"val_loss": loss})
            mgr.wait()
            assert mgr.replicator is not None
            mgr.replicator.wait()
    ids = {_name(planted).generation_id} if planted is not None else set()
    return genuine_steps(local, ids), genuine_steps(remote, ids), planted


def compare(
    tmp_path: Path,
    retention: cv.Retention,
    saves: list[tuple[int, float]],
    plant: Callable[[Path], Path],
    plant_after: int,
    dates: list[datetime] | None = None,
    dated: Callable[[list[datetime]], None] | None = None,
) -> tuple[list[int], list[int]]:
    """The genuine steps kept per tier with the forgery planted; asserts they are the
    ones kept without it."""
    if dated is not None and dates is not None:
        dated(dates)
    clean = run(tmp_path / "clean", retention, saves, None, plant_after)
    if dated is not None and dates is not None:
        dated(dates)
    attacked = run(tmp_path / "attacked", retention, saves, plant, plant_after)
    assert attacked[2] is not None
    assert attacked[:2] == clean[:2]
    return attacked[0], attacked[1]


def test_a_forged_best_generation_takes_no_slot_and_deletes_nothing(tmp_path: Path):
    """The issue's attack: keep_last=1, keep_best=1 by val_loss over both tiers; a copy
    of step 2 claims val_loss=-1. Step 1, the genuine best, survives in both tiers."""
    policy = cv.Retention(keep_last=1, keep_best=1, metric="val_loss", delete_delay=0)
    saves = [(1, 0.1), (2, 0.5), (3, 0.6), (4, 0.7)]
    local, remote = compare(
        tmp_path, policy, saves, lambda local: forge(local, 2, metrics={"val_loss": -1.0}), 2
    )
    assert 1 in local and 1 in remote


def test_a_forged_future_dated_generation_takes_no_daily_slot(tmp_path: Path, dated_ids):
    """keep_daily=3: generations of three days ago to today, and a copy of the newest
    under an id dated tomorrow. Step 2 (two days ago) keeps its day's slot in both tiers."""
    policy = cv.Retention(keep_last=1, keep_daily=3, delete_delay=0)
    saves = [(1, 0.5), (2, 0.5), (3, 0.5), (4, 0.5), (5, 0.5)]
    dates = [NOW - 3 * DAY, NOW - 2 * DAY, NOW - DAY, NOW, NOW + timedelta(seconds=1)]
    tomorrow = new_generation_id(NOW + DAY)
    local, remote = compare(
        tmp_path,
        policy,
        saves,
        lambda local: forge(local, 4, generation_id=tomorrow),
        4,
        dates,
        dated_ids,
    )
    assert 2 in local and 2 in remote


def test_a_forged_newest_step_takes_no_keep_last_slot(tmp_path: Path):
    """keep_last=3: a copy relabelled to a step above every genuine one. The third
    newest genuine generation keeps its slot in both tiers."""
    policy = cv.Retention(keep_last=3, delete_delay=0)
    saves = [(1, 0.5), (2, 0.5), (3, 0.5), (4, 0.5), (5, 0.5)]
    local, remote = compare(tmp_path, policy, saves, lambda local: forge(local, 3, step=10**6), 3)
    assert 3 in local and 3 in remote


def test_a_generation_planted_only_in_the_local_tier_decides_no_deletion(tmp_path: Path):
    """An unsigned, unencrypted run has nothing to authenticate a generation by: one
    made with ckptvault elsewhere under the run's id, with the best val_loss, and moved
    into the local tier passes restore's checks there. The replica holds no copy of
    it, so it takes no rule's place: the genuine best survives in both tiers."""

    def plant(local: Path) -> Path:
        with cv.CheckpointManager(tmp_path / "attacker", run_id="r") as evil:
            made = evil.save(2, weights(2), metrics={"val_loss": -1.0}).result()
        planted = local / Path(made.path).name
        shutil.move(made.path, planted)
        return planted

    policy = cv.Retention(keep_last=1, keep_best=1, metric="val_loss", delete_delay=0)
    saves = [(1, 0.1), (2, 0.5), (3, 0.6), (4, 0.7)]
    kept: dict[str, tuple[list[int], list[int]]] = {}
    for case, planting in (("clean", None), ("attacked", plant)):
        local, remote = tmp_path / case / "local", tmp_path / case / "remote"
        planted: Path | None = None
        with cv.CheckpointManager(
            local, run_id="r", replicate_to=remote, retention=policy
        ) as mgr:
            for done, (step, loss) in enumerate(saves):
                if done == 2 and planting is not None:
                    planted = planting(local)
                mgr.save(step, weights(step), metrics={"val_loss": loss})
                mgr.wait()
                assert mgr.replicator is not None
                mgr.replicator.wait()
        ids = set()
        if planted is not None:
            name = _name(planted)
            assert name is not None
            ids = {name.generation_id}
        kept[case] = (genuine_steps(local, ids), genuine_steps(remote, ids))
    assert kept["attacked"] == kept["clean"]
    assert 1 in kept["attacked"][0] and 1 in kept["attacked"][1]


# -- the planner's side of it ------------------------------------------------------------


def facts(step: int, loss: float, **fields: object) -> GenerationFacts:
    created = NOW - timedelta(minutes=1000 - step)
    return GenerationFacts(
        name=GenerationName(step, new_generation_id(created)),
        created=created,
        metrics={"val_loss": loss},
        verified=True,
        **fields,  # type: ignore[arg-type]
    )


def test_a_generation_rejected_in_the_first_tier_is_decided_there_only():
    """Its copy in the first tier fails the checks: that says nothing about its copies
    elsewhere (a genuine one may bear its name), so its deletion stays in that tier."""
    gens = [facts(4, 0.4), facts(3, 0.3), facts(2, 0.2, rejected="manifest-unauthenticated")]
    gens += [facts(1, 0.9)]
    policy = cv.Retention(keep_last=1, delete_delay=0)
    plan = plan_retention(
        gens, rules=policy.rules, delete_delay=0, now=NOW, home="file:///local"
    )
    decision = {d.step: d for d in plan.decisions}
    assert decision[2].action == DELETE and decision[2].only_in == ("file:///local",)
    assert decision[1].action == DELETE and decision[1].only_in == ()  # counted: every tier


@settings(max_examples=200, deadline=None)
@given(
    losses=st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=12),
    unvouched=st.sets(st.integers(0, 11)),
    rule=st.sampled_from(
        [
            cv.Retention(keep_last=2, delete_delay=0),
            cv.Retention(keep_best=2, metric="val_loss", delete_delay=0),
            cv.Retention(keep_last=1, keep_daily=2, keep_hourly=3, delete_delay=0),
            cv.Retention(keep_weekly=1, keep_every=3, delete_delay=0),
        ]
    ),
)
def test_counting_fewer_generations_never_drops_one_counting_all_keeps(
    losses: list[float], unvouched: set[int], rule: cv.Retention
):
    """What lets the planner leave unvouched generations uncounted: whatever goes
    when they are not counted also goes when they are."""
    gens = [facts(step, loss) for step, loss in enumerate(losses, start=1)]
    hours = [timedelta(hours=7 * i) for i in range(len(gens))]
    gens = [dataclasses.replace(g, created=NOW - h) for g, h in zip(gens, hours, strict=True)]
    fewer = [
        dataclasses.replace(g, unvouched="no copy") if i in unvouched else g
        for i, g in enumerate(gens)
    ]

    def going(generations: list[GenerationFacts]) -> set[GenerationName]:
        plan = plan_retention(generations, rules=rule.rules, delete_delay=0, now=NOW)
        return {d.name for d in plan.decisions if d.action in (MARK, DELETE)}

    assert going(fewer) <= going(gens)
