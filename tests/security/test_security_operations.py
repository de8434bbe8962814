"""Attacks on the operations features (drills, DONE records and supervise, status and
metrics, validation and retention, the cadence planner) by whoever can write the
store or the files beside a job. Each test performs the attack for real: real files,
real subprocesses, no mocks."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import torch

import ckptvault as cv
from ckptvault.observe.catalog import Catalog
from ckptvault.ops.drills.context import context_from_store
from ckptvault.storage import open_store
from support.common import run_cli

FUTURE_ID = "20991231T235959000000Z-deadbeef"


def _save_steps(store: Path, steps: tuple[int, ...], **options: object) -> list[Path]:
    """Publish ``steps`` of a tiny run ``r`` into ``store``; their directories, in order."""
    options.setdefault("catalog", False)
    with cv.CheckpointManager(store, run_id="r", **options) as mgr:  # type: ignore[arg-type]
        for step in steps:
            mgr.save(step, {"w": torch.full((64,), float(step)), "meta": {"s": step}})
    return sorted(p for p in store.iterdir() if p.name.startswith("step-"))


def _store_listing(store: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(store)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(store.rglob("*"))
    }


# -- status and metrics ----------------------------------------------------------------


def test_a_future_dated_generation_does_not_make_a_stale_store_healthy(tmp_path: Path):
    store, catalog = tmp_path / "store", tmp_path / "catalog.sqlite3"
    _save_steps(store, (1, 2), catalog=catalog)
    stale = run_cli("status", str(store), "--catalog", str(catalog), "--cadence-seconds", "0.001")
    assert stale.returncode == 1 and "CkptvaultCheckpointStale" in stale.stderr
    # The attack: an empty directory named like a generation from the year 2099.
    (store / f"step-000000000003.{FUTURE_ID}").mkdir()
    args = ("status", str(store), "--catalog", str(catalog), "--cadence-seconds", "0.001")
    result = run_cli(*args, "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 1, result.stdout
    assert not report["healthy"] and report["last_good_step"] == 2
    assert report["last_good_age_s"] > 0
    assert any(w["alert"] == "CkptvaultCheckpointStale" for w in report["warnings"])


def test_a_future_dated_generation_does_not_zero_the_metrics_age(tmp_path: Path):
    from ckptvault.observe.prometheus import ManagerMetrics

    store = tmp_path / "store"
    _save_steps(store, (1,))
    (store / f"step-000000000002.{FUTURE_ID}").mkdir()
    metrics = ManagerMetrics("r", open_store(store))
    assert metrics.last_good_age(time.time() + 1000.0) > 900.0


# -- drills ------------------------------------------------------------------------------


def test_drill_refuses_a_planted_sparse_file_before_filling_the_disk(tmp_path: Path):
    store = tmp_path / "store"
    newest = _save_steps(store, (1, 2))[-1]
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    info = os.statvfs(scratch)
    huge = 2 * info.f_blocks * info.f_frsize  # twice the whole filesystem, sparse
    with open(newest / "ballast.bin", "wb") as planted:
        planted.truncate(huge)
    before = _store_listing(store)
    started = time.monotonic()
    result = run_cli("drill", str(store), "--json", env={**os.environ, "TMPDIR": str(scratch)})
    assert result.returncode == 2, result.stderr
    assert "needs" in result.stderr and "--generations" in result.stderr
    assert time.monotonic() - started < 60  # refused up front, nothing copied
    assert _store_listing(store) == before  # the live store is untouched
    assert list(scratch.iterdir()) == []  # and the scratch space is gone again


def test_drill_copies_no_link_target_and_writes_nothing_live(tmp_path: Path):
    store = tmp_path / "store"
    newest = _save_steps(store, (1, 2))[-1]
    secret = tmp_path / "secret.key"
    secret.write_bytes(b"PRIVATE KEY MATERIAL")
    newest.chmod(0o755)
    (newest / "stolen.safetensors").symlink_to(secret)
    os.link(secret, newest / "linked.safetensors")  # a hard link too
    os.mkfifo(newest / "pipe.safetensors")
    before = _store_listing(store)
    scratch = tmp_path / "scratch"
    context = context_from_store(str(store), scratch)
    copied = [p for p in context.base.rglob("*") if p.is_file()]
    assert copied and all(b"PRIVATE KEY" not in p.read_bytes() for p in copied)
    assert not any(p.is_symlink() for p in context.base.rglob("*"))
    assert _store_listing(store) == before and secret.read_bytes() == b"PRIVATE KEY MATERIAL"


# -- DONE records under supervise ------------------------------------------------------------


def test_a_fifo_as_the_done_record_does_not_hang_the_supervisor(tmp_path: Path):
    done = tmp_path / "DONE.json"
    job = f"import os; os.mkfifo({str(done)!r})"
    result = run_cli(
        "supervise", "--no-catalog", "--done-file", str(done), "--", "python3", "-c", job,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 65, result.stderr
    assert "not a plain file" in result.stderr


def test_a_symlinked_done_record_is_not_followed(tmp_path: Path):
    done, target = tmp_path / "DONE.json", tmp_path / "elsewhere.json"
    target.write_text('{"kind": "not read"}')
    job = f"import os; os.symlink({str(target)!r}, {str(done)!r})"
    result = run_cli(
        "supervise", "--no-catalog", "--done-file", str(done), "--", "python3", "-c", job,
        timeout=60,
    )  # fmt: skip
    assert result.returncode == 65, result.stderr
    assert "symlink" in result.stderr and "Traceback" not in result.stderr


def test_a_planted_copy_under_the_same_id_does_not_hide_the_done_generation(tmp_path: Path):
    from ckptvault.ops.done import DoneRecord, check_done_record, manifest_digest

    store = tmp_path / "store"
    genuine = _save_steps(store, (1, 2))[-1]
    step, generation_id = 2, genuine.name.split(".", 1)[1]
    digest = manifest_digest(open_store(store), generation_id)
    planted = store / f"step-000000000099.{generation_id}"
    shutil.copytree(genuine, planted)
    record = DoneRecord("r", step, generation_id, digest, "0" * 64, 0)
    assert check_done_record(record, store=open_store(store)) == []


# -- validation and retention --------------------------------------------------------------


def _validation_factory():
    def build():
        return {"w": torch.zeros(64), "meta": {"s": -1}}

    return build


def test_a_planted_generation_under_a_validated_id_does_not_steal_its_protection(
    tmp_path: Path,
):
    store, catalog = tmp_path / "store", tmp_path / "catalog.sqlite3"
    policy = cv.Retention(keep_last=1, delete_delay=0)
    with cv.CheckpointManager(store, run_id="r", retention=policy, catalog=catalog) as mgr:
        mgr.save(1, {"w": torch.ones(64), "meta": {"s": 1}})
        result = mgr.validate(_validation_factory(), step=1)
        assert result.ok and result.generation_id is not None
        genuine = next(store.glob(f"step-*.{result.generation_id}"))
        # The attack: the validated generation's id under a far newer step.
        planted = store / f"step-000000999999.{result.generation_id}"
        shutil.copytree(genuine, planted)
        for step in range(2, 6):
            mgr.save(step, {"w": torch.full((64,), float(step)), "meta": {"s": step}})
    assert genuine.is_dir(), "retention deleted the genuine validated generation"
    with Catalog(catalog) as records:
        assert {g.step for g in records.generations() if g.validated_at} == {1}


def test_validation_refuses_a_planted_unsigned_generation(tmp_path: Path):
    from ckptvault.trust.signing import generate_keypair

    private, public = tmp_path / "k.pem", tmp_path / "k.pub"
    generate_keypair(private, public)
    store, catalog = tmp_path / "store", tmp_path / "catalog.sqlite3"
    genuine = _save_steps(store, (1,), signing_key=private, catalog=catalog)[-1]
    planted = store / f"step-000000000002.{genuine.name.split('.', 1)[1][:-8]}0badc0de"
    shutil.copytree(genuine, planted)
    (planted / "manifest.sig").chmod(0o644)
    (planted / "manifest.sig").unlink()
    ledger = tmp_path / "ledger.sqlite3"
    with cv.CheckpointManager(
        store, run_id="r", trusted_keys=[public], catalog=catalog, ledger=ledger
    ) as mgr:
        result = mgr.validate(_validation_factory())
        floor = mgr.trust.floor("r")
    assert result.ok and result.step == 1  # the genuine one, not the planted step 2
    assert floor is None or floor.step is None  # a validation never sets the rollback floor
    with Catalog(catalog) as records:
        assert {g.step for g in records.generations() if g.validated_at} == {1}


# -- the cadence planner -------------------------------------------------------------------------


def test_plan_from_a_store_is_not_sized_by_a_planted_empty_generation(tmp_path: Path):
    store = tmp_path / "store"
    _save_steps(store, (1, 2))
    (store / "step-000000009999.20200101T000000000000Z-deadbeef").mkdir()
    result = run_cli("plan", "--from", str(store), "--mtbf-hours", "10", "--save-seconds", "5",
                     "--json")  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["sources"]["checkpoint_bytes"] == "store, step 2"
    assert plan["checkpoint_bytes"] == sum(
        p.stat().st_size
        for p in next(store.glob("step-000000000002.*")).iterdir()
        if p.name not in ("manifest.json", "manifest.sig")
    )


# -- doctor ----------------------------------------------------------------------------------------


def test_doctor_checks_the_directory_a_symlinked_ledger_really_lives_in(tmp_path: Path):
    store = tmp_path / "store"
    _save_steps(store, (1,))
    private, shared = tmp_path / "private", tmp_path / "shared"
    private.mkdir(mode=0o700)
    shared.mkdir()
    shared.chmod(0o777)  # anyone may replace what lies here
    (shared / "ledger.sqlite3").write_bytes(b"")
    (shared / "ledger.sqlite3").chmod(0o600)
    (private / "ledger.sqlite3").symlink_to(shared / "ledger.sqlite3")
    result = run_cli("doctor", str(store), "--ledger", str(private / "ledger.sqlite3"), "--json")
    findings = json.loads(result.stdout)
    holes = [f for f in findings if f["check"] == "ledger directory" and f["status"] == "fail"]
    assert holes and str(shared) in holes[0]["detail"], findings
    assert result.returncode != 0
