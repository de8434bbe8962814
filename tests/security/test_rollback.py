"""The rollback floor: kept in a ledger outside the store; enforced with trusted keys
or a ledger; overridable only explicitly, which abandons the newer generations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import ckptvault as cv
from ckptvault.errors import NoValidCheckpoint, RollbackError
from ckptvault.trust.ledger import Ledger
from support.common import (
    assert_same_tensors,
    make_training_state,
    model_snapshot,
    only_tensor_file,
    train_steps,
    writable,
)


@pytest.fixture
def three_steps(store: Path, tmp_path: Path):
    ledger = tmp_path / "ledger.sqlite3"
    state = make_training_state()
    weights, paths = {}, {}
    with cv.CheckpointManager(store, run_id="r", ledger=ledger) as mgr:
        for step in (100, 200, 300):
            train_steps(state, 1)
            weights[step] = model_snapshot(state["model"])
            paths[step] = Path(mgr.save(step, state).result().path)
    return ledger, paths, weights


def mgr_for(store, ledger, **kwargs):
    return cv.CheckpointManager(store, run_id="r", ledger=ledger, **kwargs)


def test_restore_raises_the_floor_and_older_steps_are_refused(store, three_steps):
    ledger, paths, _ = three_steps
    with mgr_for(store, ledger) as mgr:
        assert mgr.restore(make_training_state()).step == 300
    floor = Ledger(ledger).floor("r")
    assert (floor.step, floor.generation_id) == (300, paths[300].name.split(".", 1)[1])
    with (
        mgr_for(store, ledger) as mgr,
        pytest.raises(RollbackError, match="below the restore floor 300"),
    ):
        mgr.restore(make_training_state(), step=200)


def test_a_corrupt_newest_cannot_push_the_run_back_silently(store, three_steps):
    ledger, paths, _ = three_steps
    with mgr_for(store, ledger) as mgr:
        mgr.restore(make_training_state())
    shard = only_tensor_file(paths[300])
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    writable(shard).write_bytes(bytes(data))
    fresh = make_training_state(seed=4)
    before = model_snapshot(fresh["model"])
    with mgr_for(store, ledger) as mgr, pytest.raises(RollbackError) as raised:
        mgr.restore(fresh)
    reasons = {step: reason.split(":")[0] for _, step, reason in raised.value.rejected}
    assert reasons == {300: "digest-mismatch", 200: "rollback", 100: "rollback"}
    assert_same_tensors(model_snapshot(fresh["model"]), before)


def test_without_ledger_or_keys_there_is_no_floor(store, three_steps):
    _, _paths, weights = three_steps
    with cv.CheckpointManager(store, run_id="r") as mgr:
        fresh = make_training_state(seed=2)
        assert mgr.restore(fresh, step=100).step == 100
    assert_same_tensors(model_snapshot(fresh["model"]), weights[100])


def test_the_floor_is_per_run(store, three_steps, tmp_path):
    ledger, _, _ = three_steps
    with mgr_for(store, ledger) as mgr:
        mgr.restore(make_training_state())
    other_store = tmp_path / "other"
    with cv.CheckpointManager(other_store, run_id="other", ledger=ledger) as mgr:
        mgr.save(5, make_training_state())
        assert mgr.restore(make_training_state()).step == 5


def test_allowed_rollback_lowers_the_floor_and_abandons_newer(
    store, three_steps, isolated_state_dir
):
    ledger, paths, weights = three_steps
    with mgr_for(store, ledger) as mgr:
        mgr.restore(make_training_state())
    fresh = make_training_state(seed=3)
    with mgr_for(store, ledger) as mgr:
        info = mgr.restore(fresh, allow_rollback_to=100)
    assert info.step == 100
    assert_same_tensors(model_snapshot(fresh["model"]), weights[100])
    book = Ledger(ledger)
    assert book.floor("r").step == 100
    abandoned = {gen for gen, _ in book.abandoned("r")}
    assert abandoned == {paths[200].name.split(".", 1)[1], paths[300].name.split(".", 1)[1]}
    # The abandoned generations are never candidates again.
    with mgr_for(store, ledger) as mgr:
        info = mgr.restore(make_training_state())
    assert info.step == 100
    assert [s.step for s in info.skipped] == [300, 200]
    assert all("abandoned" in s.reason for s in info.skipped)
    # Training on saves new generations above the floor, which restore normally.
    with mgr_for(store, ledger) as mgr:
        mgr.save(150, make_training_state())
        assert mgr.restore(make_training_state()).step == 150
    # The override is in the audit log.
    entries = [
        json.loads(line) for line in (ledger.parent / "audit.jsonl").read_text().splitlines()
    ]
    rollback = [e for e in entries if e["event"] == "rollback_allowed"]
    assert (
        len(rollback) == 1 and rollback[0]["previous_floor"] == 300 and rollback[0]["step"] == 100
    )
    assert len(rollback[0]["abandoned"]) == 2


def test_allow_rollback_to_a_missing_step(store, three_steps):
    ledger, _, _ = three_steps
    with (
        mgr_for(store, ledger) as mgr,
        pytest.raises(NoValidCheckpoint, match="no generation of step 150"),
    ):
        mgr.restore(make_training_state(), allow_rollback_to=150)


def test_trusted_keys_alone_turn_on_the_default_ledger(store, tmp_path, isolated_state_dir):
    from ckptvault.trust.signing import generate_keypair

    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    options = {
        "run_id": "r",
        "signing_key": tmp_path / "k.pem",
        "trusted_keys": [tmp_path / "k.pub"],
    }
    with cv.CheckpointManager(store, **options) as mgr:
        mgr.save(1, make_training_state())
        mgr.save(2, make_training_state())
        mgr.restore(make_training_state())
    assert Ledger(isolated_state_dir / "ledger.sqlite3").floor("r").step == 2
    with cv.CheckpointManager(store, **options) as mgr, pytest.raises(RollbackError):
        mgr.restore(make_training_state(), step=1)


def test_an_emptied_store_cannot_restart_the_run_silently(store, three_steps, tmp_path):
    import shutil

    ledger, paths, _ = three_steps
    with mgr_for(store, ledger) as mgr:
        mgr.restore(make_training_state())
    for path in paths.values():
        shutil.move(path, tmp_path / path.name)
    with (
        mgr_for(store, ledger) as mgr,
        pytest.raises(RollbackError, match="refusing to start over"),
    ):
        mgr.restore(make_training_state())


def test_an_older_save_of_the_floor_step_is_a_rollback(store, tmp_path):
    import shutil

    ledger = tmp_path / "ledger.sqlite3"
    with mgr_for(store, ledger) as mgr:
        older = Path(mgr.save(300, make_training_state()).result().path)
        newer = Path(mgr.save(300, make_training_state()).result().path)
        assert mgr.restore(make_training_state()).generation_id == newer.name.split(".", 1)[1]
    shutil.rmtree(newer)
    with (
        mgr_for(store, ledger) as mgr,
        pytest.raises(RollbackError, match="older save of step 300"),
    ):
        mgr.restore(make_training_state())
    assert older.exists()


def test_step_and_allow_rollback_to_must_agree(store, three_steps):
    ledger, _, _ = three_steps
    with mgr_for(store, ledger) as mgr, pytest.raises(cv.errors.UsageError, match="disagree"):
        mgr.restore(make_training_state(), step=200, allow_rollback_to=100)
