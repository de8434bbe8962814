"""Attacks a second hostile review found after the first round of fixes: a planted
directory that hijacks replication, JSON and file names that have no UTF-8 form, and
steps too large for the ledger. Each test performs the attack on a real store."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from blake3 import blake3

import ckptvault as cv
from ckptvault.events import Published
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.layout import MAX_STEP, parse_generation_dirname
from ckptvault.replication.replicator import Replicator
from ckptvault.storage import open_store
from ckptvault.trust.audit_verify import verify_audit_log
from ckptvault.trust.checks import TrustPolicy
from ckptvault.trust.ledger import Ledger
from ckptvault.trust.signing import generate_keypair
from support.common import run_cli


def reseal(document: dict) -> bytes:
    """What an attacker without keys does after editing a manifest."""
    body = {k: v for k, v in document.items() if k != "manifest_blake3"}
    body["manifest_blake3"] = blake3(dumps_canonical(body)).hexdigest()
    return dumps_canonical(body)


def plant_copy(generation: Path, store: Path, step: int, generation_id: str) -> Path:
    """A copy of ``generation`` renamed to ``step``/``generation_id``, manifest resealed."""
    document = json.loads((generation / "manifest.json").read_bytes())
    target = store / f"step-{step:012d}.{generation_id}"
    shutil.copytree(generation, target)
    for path in target.iterdir():
        path.chmod(0o644)
    (target / "manifest.sig").unlink(missing_ok=True)
    document.update(step=step, generation_id=generation_id)
    (target / "manifest.json").write_bytes(reseal(document))
    return target


@pytest.fixture
def signing(tmp_path: Path) -> dict:
    private, public = tmp_path / "k.pem", tmp_path / "k.pub"
    generate_keypair(private, public)
    control = tmp_path / "control"
    return {
        "signing_key": private,
        "trusted_keys": [public],
        "ledger": control / "ledger.sqlite3",
        "audit_log": control / "audit.jsonl",
    }


def test_a_directory_planted_under_the_new_id_cannot_hijack_replication(
    tmp_path: Path, signing: dict
):
    local, remote, foreign = tmp_path / "local", tmp_path / "remote", tmp_path / "foreign"
    with cv.CheckpointManager(foreign, run_id="r") as mgr:  # the attacker's own, unsigned
        mgr.save(1, {"w": torch.full((4,), 1337.0)})
    with cv.CheckpointManager(local, run_id="r", **signing) as mgr:
        info = mgr.save(100, {"w": torch.ones(4)}).result()
    # The attack: while the save runs, its id is visible in .staging; a directory of a
    # huge step planted under that id sorts first among generations with that id.
    planted = plant_copy(next(foreign.glob("step-*")), local, 999_999_999_999, info.generation_id)
    source, target = open_store(local), open_store(remote)
    replicator = Replicator(source, target, TrustPolicy(run_id="r"))
    replicator(Published("r", str(local), 100, info.generation_id, info.path, info.bytes, 0.1))
    replicator.close()
    assert [ref.step for ref in target.list_generations()] == [100]
    assert planted.exists()  # left alone in the local tier, never copied
    restored = {"w": torch.zeros(4)}
    with cv.CheckpointManager(remote, run_id="r", trusted_keys=signing["trusted_keys"]) as mgr:
        assert mgr.restore(restored).step == 100
    assert torch.equal(restored["w"], torch.ones(4))


def test_a_different_generation_under_the_same_name_is_not_taken_for_a_copy(tmp_path: Path):
    local, remote, foreign = tmp_path / "local", tmp_path / "remote", tmp_path / "foreign"
    with cv.CheckpointManager(foreign, run_id="r") as mgr:
        mgr.save(1, {"w": torch.full((4,), 1337.0)})
    with cv.CheckpointManager(local, run_id="r") as mgr:
        info = mgr.save(5, {"w": torch.ones(4)}).result()
    remote.mkdir()
    plant_copy(next(foreign.glob("step-*")), remote, 5, info.generation_id)  # pre-planted
    replicator = Replicator(open_store(local), open_store(remote), TrustPolicy(run_id="r"))
    replicator(Published("r", str(local), 5, info.generation_id, info.path, info.bytes, 0.1))
    replicator.close()
    assert replicator.status().failures == 1  # refused and logged, never reported copied
    assert not (local / ".records" / "replica").exists()


def test_a_lone_surrogate_in_a_signature_skips_the_generation(store: Path, signing: dict):
    with cv.CheckpointManager(store, run_id="r", **signing) as mgr:
        mgr.save(10, {"w": torch.ones(4)})
    good = next(store.glob("step-*"))
    evil = plant_copy(
        good, store, 99, good.name.split(".", 1)[1].replace("Z-", "Z-")[:-8] + "deadbeef"
    )
    (evil / "manifest.sig").write_bytes(
        b'{"algorithm":"ed25519","format":"ckptvault-signature/1","key_id":"\\ud800","signature":""}'
    )
    restored = {"w": torch.zeros(4)}
    with cv.CheckpointManager(store, run_id="r", **signing) as mgr:
        info = mgr.restore(restored)
    assert info.step == 10 and [s.step for s in info.skipped] == [99]
    result = run_cli(
        "verify", str(store), "--all", "--trusted-key", str(signing["trusted_keys"][0])
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert verify_audit_log(signing["audit_log"], Ledger(signing["ledger"])).ok


def test_a_file_name_that_is_not_utf8_skips_the_generation_and_is_audited(
    store: Path, signing: dict
):
    with cv.CheckpointManager(store, run_id="r", **signing) as mgr:
        mgr.save(10, {"w": torch.ones(4)})
        newest = Path(mgr.save(20, {"w": torch.full((4,), 2.0)}).result().path)
    newest.chmod(0o755)
    with open(os.path.join(os.fsencode(newest), b"\xff"), "wb") as planted:
        planted.write(b"x")
    restored = {"w": torch.zeros(4)}
    with cv.CheckpointManager(store, run_id="r", **signing) as mgr:
        info = mgr.restore(restored)
    assert info.step == 10 and "unsafe-entry" in info.skipped[0].reason
    assert "\\xff" in info.skipped[0].reason  # shown escaped, never raw
    assert verify_audit_log(signing["audit_log"], Ledger(signing["ledger"])).ok
    entries = [json.loads(line) for line in signing["audit_log"].read_text().splitlines()]
    assert entries[-1]["event"] == "restore" and entries[-1]["step"] == 10
    result = run_cli(
        "verify", str(store), "--all", "--json", env={"PYTHONIOENCODING": "utf-8:strict"}
    )
    assert result.returncode == 1 and json.loads(result.stdout)[0]["ok"] is False


def test_steps_beyond_64_bits_are_not_generations(store: Path, signing: dict):
    assert parse_generation_dirname(f"step-{MAX_STEP:012d}.20260101T000000000000Z-00000000")
    assert parse_generation_dirname(f"step-{MAX_STEP + 1}.20260101T000000000000Z-00000000") is None
    with pytest.raises(cv.errors.UsageError), cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(MAX_STEP + 1, {"w": torch.ones(1)})
    with cv.CheckpointManager(store, run_id="r", **signing) as mgr:
        mgr.save(10, {"w": torch.ones(4)})
        mgr.save(20, {"w": torch.full((4,), 2.0)})
        mgr.restore({"w": torch.zeros(4)})  # floor 20
    (store / f"step-{10**30}.20260101T000000000000Z-00000000").mkdir()  # planted
    restored = {"w": torch.zeros(4)}
    with cv.CheckpointManager(store, run_id="r", **signing) as mgr:
        info = mgr.restore(restored, allow_rollback_to=10)  # an operator's deliberate rollback
    assert info.step == 10 and torch.equal(restored["w"], torch.ones(4))
    assert Ledger(signing["ledger"]).floor("r").step == 10


def test_hiding_the_newest_generations_is_a_loud_bounded_fallback(
    store: Path, tmp_path: Path, signing: dict
):
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    with cv.CheckpointManager(store, run_id="r", **signing) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    for generation in sorted(store.glob("step-00000000002*")) + sorted(
        store.glob("step-00000000003*")
    ):
        generation.rename(hidden / generation.name)  # the attack: not corrupted, just gone
    restored = {"w": torch.zeros(4)}
    with cv.CheckpointManager(store, run_id="r", **signing) as mgr:
        info = mgr.restore(restored)
    assert info.step == 10 and [s.step for s in info.skipped] == [30, 20]
    assert all("generation-missing" in s.reason for s in info.skipped)
    with (
        cv.CheckpointManager(store, run_id="r", max_fallback=1, **signing) as mgr,
        pytest.raises(cv.errors.RollbackError, match="max_fallback=1"),
    ):
        mgr.restore({"w": torch.zeros(4)})


def test_a_store_emptied_behind_the_ledgers_back_is_not_a_fresh_start(
    tmp_path: Path, signing: dict
):
    store = tmp_path / "store"
    with cv.CheckpointManager(store, run_id="r", **signing) as mgr:
        mgr.save(10, {"w": torch.ones(4)})
    for generation in store.glob("step-*"):
        shutil.rmtree(generation)
    with (
        cv.CheckpointManager(store, run_id="r", **signing) as mgr,
        pytest.raises(cv.errors.NoValidCheckpoint, match="generation-missing"),
    ):
        mgr.restore({"w": torch.zeros(4)})  # not None: training must not restart silently


def test_generations_deleted_by_retention_are_not_missing(tmp_path: Path, signing: dict):
    store = tmp_path / "store"
    retention = cv.Retention(keep_last=2, delete_delay=0)
    with cv.CheckpointManager(store, run_id="r", retention=retention, **signing) as mgr:
        for step in (10, 20, 30, 40):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    with cv.CheckpointManager(store, run_id="r", **signing) as mgr:
        info = mgr.restore({"w": torch.zeros(4)})
    assert info.step == 40 and info.skipped == []


def test_a_planted_deletion_mark_cannot_roll_the_run_back(store: Path, signing: dict):
    with cv.CheckpointManager(store, run_id="r", max_fallback=0, **signing) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    marks = store / ".records" / "deleted"
    marks.mkdir(parents=True)
    for generation in store.glob("step-0000000000[23]0.*"):  # the attack: "retention did it"
        document = {"marked_at": "2000-01-01T00:00:00.000000Z", "reason": "keep_last"}
        (marks / f"{generation.name}.json").write_bytes(dumps_canonical(document))
    restored = {"w": torch.zeros(4)}
    with cv.CheckpointManager(store, run_id="r", max_fallback=0, **signing) as mgr:
        info = mgr.restore(restored)
    assert info.step == 30 and info.skipped == []  # the ledger made no such marks
    assert torch.equal(restored["w"], torch.full((4,), 30.0))


def test_a_generation_gone_locally_is_restored_from_the_remote_tier(tmp_path: Path, signing: dict):
    local, remote = tmp_path / "local", tmp_path / "remote"
    with cv.CheckpointManager(local, run_id="r", replicate_to=remote, **signing) as mgr:
        for step in (20, 30):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    shutil.rmtree(next(local.glob("step-000000000030.*")))
    restored = {"w": torch.zeros(4)}
    with cv.CheckpointManager(local, run_id="r", replicate_to=remote, **signing) as mgr:
        info = mgr.restore(restored)
    # Missing locally, intact remotely: not "generation-missing", and not step 20.
    assert info.step == 30 and info.path.startswith(str(remote)) and info.skipped == []
