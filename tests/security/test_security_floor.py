"""Three attacks on the restore floor, each performed for real against real stores:

1. a newer generation hidden from the store during an allowed rollback and put back
   afterwards must stay abandoned (the ledger records a rule, not only a list);
2. damage to the newest generations must not push a run back silently or without
   bound (``max_fallback``; every fallback is reported);
3. two stores with the same directory name must not accept each other's
   generations (an explicit run id is required with any trust feature).
"""

from __future__ import annotations

import json
import logging
import shutil
import sqlite3
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

import ckptvault as cv
from ckptvault.errors import NoValidCheckpoint, RollbackError, UsageError
from ckptvault.format.layout import generation_id_time, new_generation_id
from ckptvault.ops.export import export_weights
from ckptvault.trust.ledger import Ledger, RestoreFloor, RollbackRule
from ckptvault.trust.signing import generate_keypair
from support.common import (
    assert_same_tensors,
    make_training_state,
    model_snapshot,
    only_tensor_file,
    train_steps,
    writable,
)


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    generate_keypair(tmp_path / "trainer.pem", tmp_path / "trainer.pub")
    return {"private": tmp_path / "trainer.pem", "public": tmp_path / "trainer.pub"}


def gen_id(path: Path) -> str:
    return path.name.split(".", 1)[1]


def corrupt(generation: Path) -> None:
    shard = only_tensor_file(generation)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    writable(shard).write_bytes(bytes(data))


def audit_entries(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_text().splitlines()]


# -- 1. an abandoned generation must not come back ------------------------------------


@pytest.fixture
def signed_run(store: Path, tmp_path: Path, keys):
    """Steps 100, 200, 300 of run "r", signed, floor kept in a ledger; 300 restored."""
    ledger = tmp_path / "control" / "ledger.sqlite3"
    options = {
        "run_id": "r",
        "signing_key": keys["private"],
        "trusted_keys": [keys["public"]],
        "ledger": ledger,
        "audit_log": tmp_path / "control" / "audit.jsonl",
    }
    state = make_training_state()
    weights, paths = {}, {}
    with cv.CheckpointManager(store, **options) as mgr:
        for step in (100, 200, 300):
            train_steps(state, 1)
            weights[step] = model_snapshot(state["model"])
            paths[step] = Path(mgr.save(step, state).result().path)
        assert mgr.restore(make_training_state()).step == 300  # the floor is now 300
    return options, paths, weights


def test_a_generation_hidden_during_a_rollback_stays_abandoned(store, tmp_path, signed_run):
    options, paths, weights = signed_run
    hidden = tmp_path / "hidden" / paths[300].name
    hidden.parent.mkdir()
    # The attacker, who can write the store, hides the newest generation...
    shutil.move(paths[300], hidden)
    with cv.CheckpointManager(store, **options) as mgr:
        info = mgr.restore(make_training_state(), allow_rollback_to=100)
    assert info.step == 100
    # ...so the rollback's explicit list names only what was visible.
    assert {g for g, _ in Ledger(options["ledger"]).abandoned("r")} == {gen_id(paths[200])}
    # ...and puts it back afterwards.
    shutil.move(hidden, paths[300])

    fresh = make_training_state(seed=5)
    with cv.CheckpointManager(store, **options) as mgr:
        info = mgr.restore(fresh)
    assert info.step == 100
    assert_same_tensors(model_snapshot(fresh["model"]), weights[100])
    reasons = {s.step: s.reason for s in info.skipped}
    assert reasons[300].startswith("rollback: ")
    assert "abandoned by the rollback to step 100 at " in reasons[300]
    # Asked for by name, it is refused too, and nothing is applied.
    before = model_snapshot(fresh["model"])
    with (
        cv.CheckpointManager(store, **options) as mgr,
        pytest.raises(RollbackError, match="abandoned by the rollback to step 100"),
    ):
        mgr.restore(fresh, step=300)
    assert_same_tensors(model_snapshot(fresh["model"]), before)
    # Nor can it be exported (export applies abandonment, not the floor).
    with pytest.raises(NoValidCheckpoint, match="abandoned by the rollback to step 100") as refused:
        export_weights(
            store,
            300,
            tmp_path / "model.safetensors",
            run_id="r",
            trusted_keys=[options["trusted_keys"][0]],
            ledger=options["ledger"],
            audit_log=options["audit_log"],
        )
    # Export cannot roll a run back, so it does not suggest allow_rollback_to.
    assert not isinstance(refused.value, RollbackError)
    assert not (tmp_path / "model.safetensors").exists()


def test_a_save_after_the_rollback_is_restorable_and_wins(store, signed_run):
    options, paths, _ = signed_run
    with cv.CheckpointManager(store, **options) as mgr:
        mgr.restore(make_training_state(), allow_rollback_to=100)
        train = make_training_state(seed=9)
        new = Path(mgr.save(150, train).result().path)
    rule = Ledger(options["ledger"]).floor("r").rules[-1]
    assert gen_id(new) > rule.cutoff > gen_id(paths[300])
    # Abandoned generations are skipped by the ledger's decision: not a fallback, so
    # even max_fallback=0 restores the new save.
    with cv.CheckpointManager(store, max_fallback=0, **options) as mgr:
        info = mgr.restore(make_training_state())
    assert (info.step, info.generation_id) == (150, gen_id(new))
    assert [s.step for s in info.skipped] == [300, 200]


def test_rollbacks_accumulate_rules(store, tmp_path, signed_run):
    options, paths, _ = signed_run
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    shutil.move(paths[300], hidden)  # hidden during the first rollback
    with cv.CheckpointManager(store, **options) as mgr:
        mgr.restore(make_training_state(), allow_rollback_to=100)
        p250 = Path(mgr.save(250, make_training_state()).result().path)
        mgr.save(150, make_training_state())
        assert mgr.restore(make_training_state()).step == 250
    shutil.move(p250, hidden)  # hidden during the second
    with cv.CheckpointManager(store, **options) as mgr:
        assert mgr.restore(make_training_state(), allow_rollback_to=150).step == 150
    for path in (paths[300], p250):
        shutil.move(hidden / path.name, path)
    floor = Ledger(options["ledger"]).floor("r")
    assert [rule.floor_step for rule in floor.rules] == [100, 150]
    with cv.CheckpointManager(store, **options) as mgr:
        info = mgr.restore(make_training_state())
    assert info.step == 150
    reasons = {s.step: s.reason for s in info.skipped}
    assert "rollback to step 150" in reasons[250]  # the second rule
    assert "rollback to step 100" in reasons[300]  # the first still holds
    assert gen_id(paths[200]) in reasons[200]


def test_a_writer_whose_clock_is_behind_still_saves_after_the_cutoff():
    cutoff = new_generation_id(now=datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=timezone.utc))
    earlier = datetime(2024, 1, 1, tzinfo=timezone.utc)
    for _ in range(200):  # the random suffix never decides: the time itself is later
        made = new_generation_id(now=earlier, not_before=cutoff)
        assert made > cutoff
        assert generation_id_time(made) == generation_id_time(cutoff) + timedelta(microseconds=1)
    later = datetime(2032, 1, 1, tzinfo=timezone.utc)
    assert generation_id_time(new_generation_id(now=later, not_before=cutoff)) == later
    with pytest.raises(UsageError, match="not_before must be a generation id"):
        new_generation_id(not_before="yesterday")


def test_the_writer_honours_a_cutoff_from_a_clock_ahead_of_it(store, tmp_path):
    """The machine that rolled back ran an hour ahead: saves made after it still count
    as made after the rollback."""
    ledger = tmp_path / "ledger.sqlite3"
    with cv.CheckpointManager(store, run_id="r", ledger=ledger) as mgr:
        first = mgr.save(100, make_training_state()).result()
        mgr.save(200, make_training_state())
    ahead = new_generation_id(now=datetime.now(timezone.utc) + timedelta(hours=1))
    Ledger(ledger).lower_floor("r", 100, first.generation_id, [], ahead)
    with cv.CheckpointManager(store, run_id="r", ledger=ledger) as mgr:
        saved = mgr.save(150, make_training_state()).result()
        info = mgr.restore(make_training_state())
    assert saved.generation_id > ahead
    assert (info.step, info.generation_id) == (150, saved.generation_id)
    assert [s.step for s in info.skipped] == [200]


def test_a_ledger_of_an_older_version_gains_the_rules_table(tmp_path):
    path = tmp_path / "old.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(
            "CREATE TABLE floors (run_id TEXT PRIMARY KEY, step INTEGER NOT NULL, "
            "generation_id TEXT NOT NULL, updated_at TEXT NOT NULL);"
            "INSERT INTO floors VALUES ('r', 300, '20260101T000000000000Z-00000000', 'x');"
        )
    book = Ledger(path)
    assert book.floor("r").step == 300 and book.floor("r").rules == ()
    cutoff = new_generation_id()
    book.lower_floor("r", 100, "20250101T000000000000Z-00000000", [], cutoff)
    floor = book.floor("r")
    assert floor.step == 100 and floor.newest_cutoff == cutoff


def test_restore_floor_rules_refuse_only_older_generations_above_their_step():
    rule = RollbackRule(cutoff="20260101T000000000000Z-80000000", floor_step=100, created_at="t")
    floor = RestoreFloor("r", 100, "20250101T000000000000Z-00000000", rules=(rule,))
    assert floor.refuses(300, "20251231T235959999999Z-ffffffff") is not None
    assert floor.refuses(300, "20260101T000000000001Z-00000000") is None  # saved after
    assert floor.refuses(100, "20250101T000000000000Z-00000000") is None  # the floor itself
    assert floor.without_step().refuses(50, "20200101T000000000000Z-00000000") is None
    assert floor.without_step().refuses(300, "20251231T000000000000Z-00000000") is not None


# -- 2. fallback is bounded and loud --------------------------------------------------


@pytest.fixture
def four_steps(store: Path, tmp_path: Path):
    options = {
        "run_id": "r",
        "ledger": tmp_path / "control" / "ledger.sqlite3",
        "audit_log": tmp_path / "control" / "audit.jsonl",
    }
    state = make_training_state()
    weights, paths = {}, {}
    with cv.CheckpointManager(store, **options) as mgr:
        for step in (100, 200, 300, 400):
            train_steps(state, 1)
            weights[step] = model_snapshot(state["model"])
            paths[step] = Path(mgr.save(step, state).result().path)
    return options, paths, weights


def test_one_corrupt_newest_falls_back_and_says_so(store, four_steps, caplog):
    options, paths, weights = four_steps
    corrupt(paths[400])
    fresh = make_training_state(seed=3)
    with (
        caplog.at_level(logging.WARNING, logger="ckptvault"),
        cv.CheckpointManager(store, max_fallback=2, **options) as mgr,
    ):
        info = mgr.restore(fresh)
    assert info.step == 300
    assert_same_tensors(model_snapshot(fresh["model"]), weights[300])
    assert [(s.generation_id, s.step) for s in info.skipped] == [(gen_id(paths[400]), 400)]
    assert info.skipped[0].reason.startswith("digest-mismatch")
    summary = [r.getMessage() for r in caplog.records if "after skipping" in r.getMessage()]
    assert len(summary) == 1
    assert (
        "restored step 300" in summary[0] and "after skipping 1 newer generation(s)" in summary[0]
    )
    restores = [e for e in audit_entries(options["audit_log"]) if e["event"] == "restore"]
    assert restores[-1]["step"] == 300
    assert [s[:2] for s in restores[-1]["skipped"]] == [[gen_id(paths[400]), 400]]
    assert restores[-1]["skipped"][0][2].startswith("digest-mismatch")


def test_more_corrupt_generations_than_max_fallback_is_refused(store, four_steps):
    options, paths, _ = four_steps
    for step in (400, 300, 200):
        corrupt(paths[step])
    fresh = make_training_state(seed=3)
    before = model_snapshot(fresh["model"])
    meta_before = json.dumps(fresh["meta"])
    with (
        cv.CheckpointManager(store, max_fallback=1, **options) as mgr,
        pytest.raises(RollbackError) as raised,
    ):
        mgr.restore(fresh)
    message = str(raised.value)
    assert "more than max_fallback=1" in message and "state is unchanged" in message
    # With a ledger an explicit older step is a rollback too: the way out says so.
    assert "raise max_fallback" in message and "restore(state, allow_rollback_to=" in message
    assert [step for _, step, _ in raised.value.rejected] == [400, 300]
    assert all(reason.startswith("digest-mismatch") for *_, reason in raised.value.rejected)
    assert_same_tensors(model_snapshot(fresh["model"]), before)
    assert json.dumps(fresh["meta"]) == meta_before
    # Nothing was restored: the floor did not move, and the refusal is on record.
    assert Ledger(options["ledger"]).floor("r").step is None
    refusals = [e for e in audit_entries(options["audit_log"]) if e["event"] == "refusal"]
    assert refusals[-1]["error"] == "RollbackError"
    # The bound is what refused: a wider one, or a rollback on purpose, restores 100.
    # (An explicit step=100 counts the damaged newer generations as restore(state)
    # does, so max_fallback=0 refuses it too.)
    with cv.CheckpointManager(store, max_fallback=3, **options) as mgr:
        assert mgr.restore(make_training_state()).step == 100
    with (
        cv.CheckpointManager(store, max_fallback=0, **options) as mgr,
        pytest.raises(RollbackError, match="max_fallback=0") as raised,
    ):
        mgr.restore(make_training_state(), step=100)
    assert "allow_rollback_to=" in str(raised.value)
    with cv.CheckpointManager(store, max_fallback=0, **options) as mgr:
        info = mgr.restore(make_training_state(), allow_rollback_to=100)
    assert info.step == 100 and info.skipped == []


def test_max_fallback_counts_only_the_chosen_steps_generations_on_a_rollback(store, tmp_path):
    # An allowed rollback goes back past newer generations on purpose: only the
    # chosen step's own failed generations count. (Without the allowance, step 7 is
    # refused outright: step 8 is newer and verifies.)
    options = {"run_id": "r", "ledger": tmp_path / "ledger.sqlite3"}
    with cv.CheckpointManager(store, **options) as mgr:
        older = Path(mgr.save(7, make_training_state()).result().path)
        newer = Path(mgr.save(7, make_training_state()).result().path)
        mgr.save(8, make_training_state())
    corrupt(newer)
    with (
        cv.CheckpointManager(store, max_fallback=0, **options) as mgr,
        pytest.raises(RollbackError, match="max_fallback=0"),
    ):
        mgr.restore(make_training_state(), allow_rollback_to=7)
    with cv.CheckpointManager(store, max_fallback=1, **options) as mgr:
        info = mgr.restore(make_training_state(), allow_rollback_to=7)
    assert info.generation_id == gen_id(older) and info.rolled_back_from == 8


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_max_fallback_is_validated(store, bad):
    with pytest.raises(UsageError, match="max_fallback must be None"):
        cv.CheckpointManager(store, run_id="r", max_fallback=bad)


# -- 3. a store's name is not a run's identity ----------------------------------------


def test_same_named_stores_need_explicit_run_ids_and_then_refuse_each_other(tmp_path, keys):
    store_a, store_b = tmp_path / "expA" / "run42", tmp_path / "expB" / "run42"
    common = {
        "signing_key": keys["private"],
        "trusted_keys": [keys["public"]],
        "ledger": tmp_path / "ledger.sqlite3",
    }
    with cv.CheckpointManager(store_a, run_id="expA/run42", **common) as mgr:
        mgr.save(10, make_training_state())
    with cv.CheckpointManager(store_b, run_id="expB/run42", **common) as mgr:
        planted = Path(mgr.save(20, make_training_state(seed=1)).result().path)
    # Someone copies B's newer, validly signed generation into A.
    shutil.copytree(planted, store_a / planted.name)
    with cv.CheckpointManager(store_a, run_id="expA/run42", **common) as mgr:
        info = mgr.restore(make_training_state())
    assert info.step == 10
    assert [(s.step, s.reason.split(":")[0]) for s in info.skipped] == [(20, "run-mismatch")]
    with (
        cv.CheckpointManager(store_a, run_id="expA/run42", **common) as mgr,
        pytest.raises(NoValidCheckpoint, match="run-mismatch"),
    ):
        mgr.restore(make_training_state(), step=20)


@pytest.mark.parametrize(
    "option", ["signing_key", "trusted_keys", "keystore", "ledger", "audit_log"]
)
def test_trust_features_require_an_explicit_run_id(tmp_path, keys, option):
    values = {
        "signing_key": keys["private"],
        "trusted_keys": [keys["public"]],
        "keystore": tmp_path / "keys",
        "ledger": tmp_path / "ledger.sqlite3",
        "audit_log": tmp_path / "audit.jsonl",
    }
    store = tmp_path / "expA" / "run42"
    with pytest.raises(UsageError) as raised:
        cv.CheckpointManager(store, **{option: values[option]})
    message = str(raised.value)
    assert "the default run id, the store directory's name 'run42', is not unique" in message
    assert option in message and "pass run_id=" in message
    assert not store.exists() and not (tmp_path / "keys").exists()


def test_without_trust_features_the_default_run_id_is_the_directory_name(tmp_path):
    with cv.CheckpointManager(tmp_path / "expA" / "run42") as mgr:
        assert mgr.run_id == "run42"
