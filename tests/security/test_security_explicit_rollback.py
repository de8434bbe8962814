"""Issue 23, item 2 (the manager's part): with a ledger, an explicit older step is a
rollback.

A signed run with ``trusted_keys``, a ledger and ``max_fallback=0`` saves steps 10
to 40. Asking for step 10 by name (what a planted Lightning pointer, an old
``checkpoint-N`` path or a script's stale step turns into) used to restore it: no
error, empty ``skipped``, ``max_fallback`` never consulted. Now the newer
generations restore would trust come first: one that passes the checks needing no
tensor byte makes it a ``RollbackError`` (nothing applied); those that fail, or that
the ledger saw published and the store no longer holds, are skipped and counted by
``max_fallback``. ``allow_rollback_to`` goes back on purpose: logged at WARNING,
audited, and shown in ``RestoreInfo.rolled_back_from``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

import ckptvault as cv
from ckptvault.errors import RollbackError
from ckptvault.trust.ledger import Ledger
from ckptvault.trust.signing import generate_keypair
from support.common import (
    assert_same_tensors,
    make_training_state,
    model_snapshot,
    train_steps,
)
from support.forging import read_logical, write_logical
from support.multirank import launch


def ok(codes: list[int], reports: list[dict]) -> list[dict]:
    assert codes == [0] * len(codes), reports
    return reports


STEPS = (10, 20, 30, 40)


@pytest.fixture
def signed_run(store: Path, tmp_path: Path) -> tuple[dict, dict[int, Path], dict[int, dict]]:
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    options = {
        "run_id": "r",
        "signing_key": tmp_path / "k.pem",
        "trusted_keys": [tmp_path / "k.pub"],
        "ledger": tmp_path / "control" / "ledger.sqlite3",
        "audit_log": tmp_path / "control" / "audit.jsonl",
        "max_fallback": 0,
    }
    state = make_training_state()
    paths, weights = {}, {}
    with cv.CheckpointManager(store, **options) as mgr:
        for step in STEPS:
            train_steps(state, 1)
            weights[step] = model_snapshot(state["model"])
            paths[step] = Path(mgr.save(step, state).result().path)
    return options, paths, weights


def audit(options: dict, event: str) -> list[dict]:
    entries = [json.loads(line) for line in options["audit_log"].read_text().splitlines()]
    return [e for e in entries if e["event"] == event]


def test_an_explicit_older_step_is_refused_as_a_rollback(store, signed_run):
    options, _paths, _ = signed_run
    fresh = make_training_state(seed=7)
    before = model_snapshot(fresh["model"])
    with cv.CheckpointManager(store, **options) as mgr, pytest.raises(RollbackError) as raised:
        mgr.restore(fresh, step=10)
    message = str(raised.value)
    assert "step 10 is older than" in message and "(step 40)" in message
    assert "allow_rollback_to=10" in message and "state is unchanged" in message
    assert_same_tensors(model_snapshot(fresh["model"]), before)
    assert fresh["meta"] == {"tokens_seen": 0, "history": []}
    assert Ledger(options["ledger"]).floor("r").step is None  # nothing was restored
    assert audit(options, "refusal")[-1]["error"] == "RollbackError"
    # The newest step itself is no rollback.
    with cv.CheckpointManager(store, **options) as mgr:
        assert mgr.restore(make_training_state(), step=40).step == 40


def test_allow_rollback_to_goes_back_loudly_and_is_shown(store, signed_run, caplog):
    options, paths, weights = signed_run
    fresh = make_training_state(seed=7)
    with (
        caplog.at_level(logging.WARNING, logger="ckptvault"),
        cv.CheckpointManager(store, **options) as mgr,
    ):
        info = mgr.restore(fresh, allow_rollback_to=10)
    assert info.step == 10 and info.rolled_back_from == 40 and info.skipped == []
    assert_same_tensors(model_snapshot(fresh["model"]), weights[10])
    assert any(
        "rolled back on purpose from step 40 to step 10" in r.message for r in caplog.records
    )
    (entry,) = audit(options, "rollback_allowed")
    assert (entry["from_step"], entry["step"], entry["previous_floor"]) == (40, 10, None)
    assert sorted(step for _, step in entry["abandoned"]) == [20, 30, 40]
    # From now on the newer generations are abandoned: step 10 is what restore takes,
    # and asking for it by name is no rollback any more.
    with cv.CheckpointManager(store, **options) as mgr:
        info = mgr.restore(make_training_state(), step=10)
    assert info.step == 10 and info.rolled_back_from is None
    assert paths[40].exists()  # abandoned, not deleted


def test_hidden_newer_generations_are_skipped_and_counted(store, signed_run, tmp_path):
    # Moving the newer generations out of the store does not make step 10 the newest:
    # the ledger saw them published; each is a candidate that fails, so max_fallback=0
    # refuses, and a wider bound restores step 10 listing every one of them.
    options, paths, weights = signed_run
    for step in (20, 30, 40):
        shutil.move(paths[step], tmp_path / paths[step].name)
    with (
        cv.CheckpointManager(store, **options) as mgr,
        pytest.raises(RollbackError, match="max_fallback=0") as raised,
    ):
        mgr.restore(make_training_state(), step=10)
    assert [step for _, step, _ in raised.value.rejected] == [40]
    fresh = make_training_state(seed=7)
    with cv.CheckpointManager(store, **{**options, "max_fallback": 3}) as mgr:
        info = mgr.restore(fresh, step=10)
    assert info.step == 10 and info.rolled_back_from is None
    assert [(s.step, s.reason.split(":")[0]) for s in info.skipped] == [
        (40, "generation-missing"),
        (30, "generation-missing"),
        (20, "generation-missing"),
    ]
    assert_same_tensors(model_snapshot(fresh["model"]), weights[10])


def test_a_newer_generation_that_fails_the_checks_is_a_fallback(store, signed_run, tmp_path):
    # An unsigned step 50 planted in the store is no reason to refuse step 40, but it
    # is a generation restore(state) would have skipped: counted, and listed.
    options, _paths, _ = signed_run
    unsigned = {k: v for k, v in options.items() if k not in ("signing_key", "trusted_keys")}
    unsigned.update(ledger=tmp_path / "other.sqlite3", audit_log=tmp_path / "other.jsonl")
    with cv.CheckpointManager(tmp_path / "elsewhere", **unsigned) as mgr:
        planted = Path(mgr.save(50, make_training_state()).result().path)
    shutil.copytree(planted, store / planted.name)
    with (
        cv.CheckpointManager(store, **options) as mgr,
        pytest.raises(RollbackError, match="max_fallback=0"),
    ):
        mgr.restore(make_training_state(), step=40)
    with cv.CheckpointManager(store, **{**options, "max_fallback": 1}) as mgr:
        info = mgr.restore(make_training_state(), step=40)
    assert info.step == 40
    assert [(s.step, s.reason.split(":")[0]) for s in info.skipped] == [(50, "signature-missing")]


def test_an_encrypted_run_checks_the_newer_manifests_mac(store, tmp_path):
    # No signatures: the manifest's MAC is what restore trusts, so it is what decides
    # whether a newer generation counts. One whose manifest was edited does not.
    options = {
        "run_id": "r",
        "keystore": tmp_path / "keys",
        "ledger": tmp_path / "control" / "ledger.sqlite3",
        "max_fallback": 1,
    }
    with cv.CheckpointManager(store, **options) as mgr:
        mgr.save(10, make_training_state())
        newer = Path(mgr.save(20, make_training_state()).result().path)
    with cv.CheckpointManager(store, **options) as mgr, pytest.raises(RollbackError):
        mgr.restore(make_training_state(), step=10)
    document = read_logical(newer)
    document["metrics"] = {"loss": 0.0}  # an edit the MAC covers
    write_logical(newer, document)
    with cv.CheckpointManager(store, **options) as mgr:
        info = mgr.restore(make_training_state(), step=10)
    assert info.step == 10
    assert [(s.step, s.reason.split(":")[0]) for s in info.skipped] == [
        (20, "manifest-unauthenticated")
    ]


def test_without_a_ledger_an_explicit_step_is_what_it_was(store, signed_run):
    # No ledger, no trusted keys: no floor and no rollback rule (docs/security.md).
    _options, _paths, weights = signed_run
    fresh = make_training_state(seed=7)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(fresh, step=10)
    assert info.step == 10 and info.skipped == [] and info.rolled_back_from is None
    assert_same_tensors(model_snapshot(fresh["model"]), weights[10])


def keep_only(store: Path, step: int) -> None:
    for generation in store.glob("step-*"):
        if int(generation.name[5:17]) != step:
            shutil.rmtree(generation)


@pytest.mark.parametrize(("local_keeps", "remote_keeps"), [(10, None), (40, 10)])
def test_a_newer_generation_in_another_tier_counts_too(tmp_path, local_keeps, remote_keeps):
    # The local tier lost the newer steps (a replaced disk, per-tier retention), or
    # holds only the newest while the replica holds only step 10: a generation newer
    # than step 10 that verifies in any tier makes step 10 a rollback.
    local, remote = tmp_path / "local", tmp_path / "remote"
    options = {"run_id": "r", "ledger": tmp_path / "control" / "ledger.sqlite3"}
    with cv.CheckpointManager(local, replicate_to=remote, **options) as mgr:
        for step in STEPS:
            mgr.save(step, make_training_state())
    keep_only(local, local_keeps)
    if remote_keeps is not None:
        keep_only(remote, remote_keeps)
    with (
        cv.CheckpointManager(local, replicate_to=remote, **options) as mgr,
        pytest.raises(RollbackError, match=r"\(step 40\)"),
    ):
        mgr.restore(make_training_state(), step=10)


def test_every_rank_refuses_an_explicit_older_step_together(tmp_path, monkeypatch):
    # Rank 0 chooses (and checks the newer generation alone); every rank raises the
    # same RollbackError with nothing applied, then rolls back on purpose together.
    store = tmp_path / "store"
    ok(*launch("save", store, 2, tmp_path / "save"))
    monkeypatch.setenv("TEST_LEDGER", str(tmp_path / "control" / "ledger.sqlite3"))
    reports = ok(*launch("restore_older_step", store, 2, tmp_path / "restore"))
    for report in reports:
        assert "step 1 is older than generation" in report["refused"]
        assert report["untouched"] and report["step"] == 1 and report["bias"] == [1.0] * 3
    assert [r["rolled_back_from"] for r in reports] == [2, None]  # the coordinator's


def test_an_allowance_is_applied_once_so_a_requeued_job_keeps_its_work(store, signed_run):
    """A requeued job starts with the same ``allow_rollback_to=10``: once the run has
    saved after rolling back, applying it again would abandon that work. Refused
    (nothing applied); without the option the job resumes its newest generation.
    Before anything was saved since, the same allowance is harmless and still taken."""
    options, _paths, _ = signed_run
    state = make_training_state(seed=3)
    with cv.CheckpointManager(store, **options) as mgr:
        assert mgr.restore(state, allow_rollback_to=10).step == 10
    with cv.CheckpointManager(store, **options) as mgr:  # crashed before saving: again
        first = mgr.restore(state, allow_rollback_to=10)
        assert first.step == 10
        mgr.save(11, state)
        mgr.save(12, state)
    fresh = make_training_state(seed=8)
    before = model_snapshot(fresh["model"])
    with cv.CheckpointManager(store, **options) as mgr:
        with pytest.raises(RollbackError) as raised:
            mgr.restore(fresh, allow_rollback_to=10)
        assert "already rolled back to step 10" in str(raised.value)
        assert "(newest: step 12" in str(raised.value)
        assert_same_tensors(model_snapshot(fresh["model"]), before)  # nothing applied
        assert mgr.restore(fresh).step == 12
        assert {11, 12} <= {g.step for g in mgr.generations()}  # the work since, kept
