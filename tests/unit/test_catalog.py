"""The catalog: what every save and restore cost, which generations exist, what failed.

Real managers on real stores write it through their events; the tests read it back
through the public API and the ``ckptvault catalog`` command.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import CatalogError, KeyUnavailableError, NoValidCheckpoint, UsageError
from ckptvault.observe.catalog import Catalog, SaveRecord, default_catalog_path
from ckptvault.observe.catalog_schema import SCHEMA_VERSION
from ckptvault.trust.keystore import LocalKeyStore
from support.common import (
    REPO,
    make_training_state,
    only_tensor_file,
    run_cli,
    train_steps,
    writable,
)

SAVE_STAGES = {"write", "fsync", "publish"}
RESTORE_STAGES = {"discovery", "verification", "read", "apply"}


class FailingKeyStore(LocalKeyStore):
    """A real key store that stops wrapping keys on demand (an unreachable KMS)."""

    fail = False

    def wrap(self, run_id: str, data_key: bytes, context: bytes) -> tuple[str, bytes]:
        if self.fail:
            raise KeyUnavailableError("the KMS is unreachable")
        return super().wrap(run_id, data_key, context)


@pytest.fixture
def catalog_path(isolated_state_dir: Path) -> Path:
    """Where the manager keeps the catalog by default: beside the default ledger."""
    return isolated_state_dir / "catalog.sqlite3"


def _assert_stages_fit(record: SaveRecord, expected: set[str]) -> None:
    assert set(record.stages) == expected
    assert all(seconds >= 0 for seconds in record.stages.values())
    assert sum(record.stages.values()) <= record.seconds + 1e-6
    assert record.stall_seconds <= record.seconds + 1e-6


def test_sync_and_async_saves_are_recorded_with_stage_timings(store: Path, catalog_path: Path):
    state = make_training_state()
    with cv.CheckpointManager(store, run_id="r", contract={"lr": 0.01}) as mgr:
        train_steps(state, 1)
        mgr.save(1, state, metrics={"val_loss": 0.25, "tokens": 400})
        mgr.save(2, state, blocking=False).result()
    assert default_catalog_path(catalog_path.parent / "ledger.sqlite3") == catalog_path
    with Catalog(catalog_path) as catalog:
        newest, oldest = catalog.recent_saves()
        generations = catalog.generations()
    assert (newest.step, oldest.step) == (2, 1) and newest.ok and oldest.ok
    # Synchronous: the whole save blocked training; no staging copy.
    _assert_stages_fit(oldest, SAVE_STAGES)
    assert oldest.stall_seconds == oldest.seconds
    # Asynchronous: the copy into staging buffers is the stall's main part.
    _assert_stages_fit(newest, SAVE_STAGES | {"stage"})
    assert newest.stages["stage"] <= newest.stall_seconds <= newest.seconds
    assert newest.store == str(store.resolve()) and newest.run_id == "r"
    assert newest.bytes > 0 and newest.error is None
    assert [g.step for g in generations] == [2, 1]
    assert {g.generation_id for g in generations} == {newest.generation_id, oldest.generation_id}
    first = generations[1]
    assert first.metrics == {"val_loss": 0.25, "tokens": 400}
    assert generations[0].metrics == {}
    assert first.tiers == (str(store.resolve()),) and first.bytes == oldest.bytes
    assert first.contract is not None and first.contract["fields"] == {"lr": 0.01}
    assert first.contract_digest == generations[0].contract_digest  # one contract, one digest
    assert first.validated_at is None


def test_the_catalog_is_private_and_versioned(store: Path, catalog_path: Path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"w": torch.ones(3)})
    assert stat.S_IMODE(catalog_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(catalog_path.parent.stat().st_mode) == 0o700
    db = sqlite3.connect(catalog_path)
    try:
        assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert db.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
        db.commit()
    finally:
        db.close()
    with pytest.raises(CatalogError, match="newer than this ckptvault"):
        Catalog(catalog_path)


def test_restores_and_refusals_are_recorded(store: Path, catalog_path: Path):
    state = make_training_state()
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, state)
        assert mgr.restore(make_training_state(1)) is not None
        generation = mgr.generations()[0]
        tensor_file = writable(only_tensor_file(Path(generation.path)))
        data = bytearray(tensor_file.read_bytes())
        data[-1] ^= 0xFF
        tensor_file.write_bytes(bytes(data))
        with pytest.raises(NoValidCheckpoint):
            mgr.restore(make_training_state(2))
    with Catalog(catalog_path) as catalog:
        refused, restored = catalog.recent_restores()
        (failure,) = catalog.failures()
    assert restored.ok and restored.step == 1 and restored.generation_id == generation.generation_id
    assert set(restored.stages) == RESTORE_STAGES
    assert sum(restored.stages.values()) <= restored.seconds + 1e-6
    # The damaged generation was found out before anything was applied.
    assert not refused.ok and refused.step is None and refused.skipped == 1
    assert refused.error is not None and refused.error.startswith("NoValidCheckpoint: ")
    assert {"discovery", "verification"} <= set(refused.stages)
    assert "apply" not in refused.stages
    assert (failure.kind, failure.error, failure.run_id) == ("restore", "NoValidCheckpoint", "r")


def test_a_save_that_fails_while_writing_is_a_failure(store: Path, tmp_path: Path, catalog_path):
    keystore = FailingKeyStore(tmp_path / "keys")
    with cv.CheckpointManager(store, run_id="r", keystore=keystore, async_save=True) as mgr:
        mgr.save(1, {"w": torch.ones(4)}).result()
        keystore.fail = True
        with pytest.raises(KeyUnavailableError):
            mgr.save(2, {"w": torch.ones(4)}).result()
        keystore.fail = False
    with Catalog(catalog_path) as catalog:
        failed, published = catalog.recent_saves()
        (failure,) = catalog.failures()
        assert [g.step for g in catalog.generations()] == [1]
    assert published.ok and published.step == 1
    assert (failed.ok, failed.step, failed.generation_id, failed.bytes) == (False, 2, None, 0)
    assert failed.error == "KeyUnavailableError: the KMS is unreachable"
    assert 0 < failed.stall_seconds <= failed.seconds
    assert (failure.kind, failure.step, failure.error) == ("save", 2, "KeyUnavailableError")
    assert failure.reason == "the KMS is unreachable"


def test_a_save_refused_before_any_io_is_not_recorded(store: Path, catalog_path: Path):
    """An unsupported value is the caller's bug, raised by save() itself: it says
    nothing about the storage, so it does not count against the failure rate."""
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        with pytest.raises(TypeError):
            mgr.save(2, {"w": torch.ones(2), "bad": object()})
    with Catalog(catalog_path) as catalog:
        assert [s.step for s in catalog.recent_saves()] == [1]
        assert catalog.failures() == []


def test_catalog_false_writes_nothing(store: Path, isolated_state_dir: Path):
    with cv.CheckpointManager(store, run_id="r", catalog=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        mgr.restore({"w": torch.zeros(2)})
    assert not (isolated_state_dir / "catalog.sqlite3").exists()


def test_catalog_path_option_and_validation(store: Path, tmp_path: Path, catalog_path: Path):
    elsewhere = tmp_path / "ops" / "runs.sqlite3"
    with cv.CheckpointManager(store, run_id="r", catalog=elsewhere) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    assert not catalog_path.exists()
    with Catalog(elsewhere) as catalog:
        assert [s.step for s in catalog.recent_saves()] == [1]
    # Beside a ledger given with ledger=.
    with cv.CheckpointManager(store, run_id="r", ledger=tmp_path / "trust" / "ledger.sqlite3"):
        pass
    with cv.CheckpointManager(
        store, run_id="r", ledger=tmp_path / "trust" / "ledger.sqlite3"
    ) as mgr:
        mgr.save(2, {"w": torch.ones(2)})
    with Catalog(tmp_path / "trust" / "catalog.sqlite3") as catalog:
        assert [s.step for s in catalog.recent_saves()] == [2]
    with pytest.raises(UsageError, match="inside the checkpoint store"):
        cv.CheckpointManager(store, run_id="r", catalog=store / "catalog.sqlite3")
    with pytest.raises(UsageError, match="catalog=3"):
        cv.CheckpointManager(store, run_id="r", catalog=3)  # type: ignore[typeddict-item]


def test_a_broken_catalog_never_fails_a_save(store: Path, tmp_path: Path, caplog):
    not_a_database = tmp_path / "catalog.sqlite3"
    not_a_database.write_bytes(b"this is not a SQLite database" * 100)
    caplog.set_level(logging.WARNING, logger="ckptvault")
    with cv.CheckpointManager(store, run_id="r", catalog=not_a_database) as mgr:
        handle = mgr.save(1, {"w": torch.ones(2)})
        assert handle.result() is not None
        assert [g.step for g in mgr.generations()] == [1]
    (warning,) = [r.getMessage() for r in caplog.records if "catalog" in r.getMessage()]
    assert "(step 1) was published, but recording it in the catalog" in warning
    assert str(not_a_database) in warning


def test_replication_adds_a_tier_and_deletion_ends_the_record(
    store: Path, tmp_path: Path, catalog_path: Path
):
    replica = tmp_path / "replica"
    keep_one = cv.Retention(keep_last=1, delete_delay=0)
    with cv.CheckpointManager(store, run_id="r", replicate_to=replica, retention=keep_one) as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        mgr.replicator.wait()  # type: ignore[union-attr]
        with Catalog(catalog_path) as catalog:
            (first,) = catalog.generations()
        assert first.tiers == (str(store.resolve()), str(replica.resolve()))
        mgr.save(2, {"w": torch.ones(2)})
        mgr.replicator.wait()  # type: ignore[union-attr]
        mgr.save(3, {"w": torch.ones(2)})  # retention runs after each publish
        mgr.replicator.wait()  # type: ignore[union-attr]
    with Catalog(catalog_path) as catalog:
        steps = [g.step for g in catalog.generations()]
        saves = [s.step for s in catalog.recent_saves()]
    assert 1 not in steps and 3 in steps
    assert saves == [3, 2, 1]  # the save history stays


def test_mark_validated(store: Path, catalog_path: Path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"w": torch.ones(2)})
        generation_id = mgr.generations()[0].generation_id
    with Catalog(catalog_path) as catalog:
        assert catalog.mark_validated(generation_id, 1700000000.5)
        assert not catalog.mark_validated("no-such-generation", time.time())
        (record,) = catalog.generations(store=str(store.resolve()), run_id="r")
        assert catalog.generations(run_id="other") == []
    assert record.validated_at == 1700000000.5


WRITER = textwrap.dedent(
    """
    import sys, torch, ckptvault as cv
    store, catalog, run = sys.argv[1:4]
    with cv.CheckpointManager(store, run_id=run, catalog=catalog) as mgr:
        for step in range(1, 9):
            mgr.save(step, {"w": torch.full((64,), float(step))})
    """
)


def test_two_processes_write_one_catalog(tmp_path: Path):
    catalog = tmp_path / "shared" / "catalog.sqlite3"
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path / f"store{i}"), str(catalog), f"run{i}"],
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    with cv.CheckpointManager(tmp_path / "store-main", run_id="main", catalog=catalog) as mgr:
        for step in range(1, 9):
            mgr.save(step, {"w": torch.zeros(64)})
    for worker in workers:
        _, errors = worker.communicate(timeout=240)
        assert worker.returncode == 0, errors
        assert "catalog" not in errors  # no warning: nothing was lost
    with Catalog(catalog) as book:
        saves = book.recent_saves(limit=100)
        for run in ("run0", "run1", "main"):
            assert sorted(s.step for s in saves if s.run_id == run) == list(range(1, 9))
            assert len(book.generations(run_id=run)) == 8
    assert all(s.ok for s in saves)
    finished = [s.finished_at for s in saves]
    assert finished == sorted(finished, reverse=True)  # newest first


def test_cli_prints_the_catalog(store: Path, tmp_path: Path, catalog_path: Path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"w": torch.ones(2)}, metrics={"loss": 1.5})
        mgr.restore({"w": torch.zeros(2)})
    with cv.CheckpointManager(tmp_path / "other", run_id="o") as mgr:
        mgr.save(7, {"w": torch.ones(2)})
    env = {"XDG_STATE_HOME": str(catalog_path.parent.parent)}
    result = run_cli("catalog", "--store", str(store), "--json", env=env)
    assert result.returncode == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["catalog"] == str(catalog_path)
    (save,) = shown["saves"]
    assert save["step"] == 1 and save["ok"] is True and save["error"] is None
    assert set(save["stages"]) == SAVE_STAGES
    assert {"seconds", "stall_seconds", "bytes", "finished_at", "generation_id"} <= set(save)
    (restore,) = shown["restores"]
    assert restore["ok"] is True and set(restore["stages"]) == RESTORE_STAGES
    assert shown["failures"] == []
    assert [g["metrics"] for g in shown["generations"]] == [{"loss": 1.5}]
    # Both stores, through --catalog; and a readable table.
    everything = json.loads(run_cli("catalog", "--catalog", str(catalog_path), "--json").stdout)
    assert sorted(s["step"] for s in everything["saves"]) == [1, 7]
    ledger = str(catalog_path.parent / "ledger.sqlite3")
    table = run_cli("catalog", "--ledger", ledger, env={"COLUMNS": "200"})
    assert table.returncode == 0, table.stderr
    assert "saves" in table.stdout and "fsync s" in table.stdout and "restores" in table.stdout
    missing = run_cli("catalog", "--catalog", str(tmp_path / "none.sqlite3"))
    assert missing.returncode == 2 and "no catalog at" in missing.stderr


def test_only_the_coordinator_of_a_job_records(tmp_path: Path, catalog_path: Path):
    """Every rank of a job shares the state directory; the job's saves and restores
    are recorded once each, by rank 0."""
    from support.multirank import launch

    store = tmp_path / "store"
    codes, _ = launch("save", store, 2, tmp_path / "save")
    assert codes == [0, 0]
    codes, _ = launch("restore", store, 2, tmp_path / "restore")
    assert codes == [0, 0]
    with Catalog(catalog_path) as catalog:
        saves = catalog.recent_saves()
        (restore,) = catalog.recent_restores()
        generations = catalog.generations()
    assert sorted(s.step for s in saves) == [1, 2] and all(s.ok for s in saves)
    for save in saves:
        assert set(save.stages) == SAVE_STAGES
        assert sum(save.stages.values()) <= save.seconds + 1e-6
    assert [g.step for g in generations] == [2, 1]
    assert restore.ok and restore.step == 2 and restore.run_id == "job"


def test_a_catalog_of_the_first_schema_is_brought_along(tmp_path: Path):
    """A catalog written before validations and supervised attempts were recorded
    gains their tables when it is next opened, and keeps its rows."""
    from ckptvault.observe.catalog_attempts import recent_attempts

    path = tmp_path / "catalog.sqlite3"
    with cv.CheckpointManager(tmp_path / "store", run_id="r", catalog=path) as mgr:
        mgr.save(1, {"x": torch.ones(2)})
    db = sqlite3.connect(path)
    db.executescript(
        "DROP TABLE validations; DROP TABLE attempts; DELETE FROM schema_version; "
        "INSERT INTO schema_version (version) VALUES (1);"
    )
    db.close()
    with Catalog(path) as catalog:
        assert [s.step for s in catalog.recent_saves()] == [1]
        assert catalog.failures() == [] and recent_attempts(catalog) == []
        assert catalog.query("SELECT MAX(version) FROM schema_version", [])[0][0] == 2
