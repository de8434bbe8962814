"""Replication copies only what a restore would accept (red-team finding A05).

Whoever can write only the fast local tier plants a generation there, with a huge
step and the run's id. Before the fix the next process's catch-up copied it into the
durable tier, where it counted as verified, became the replica's "newest" and made
the replica's retention delete genuine generations. Now, in an encrypted run, a copy
must be encrypted throughout and carry a manifest MAC made with the run's key, and
with a ledger the catch-up copies only generations the ledger saw published. Each
attack runs against a real local-directory replica and a real S3 (moto) replica.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from blake3 import blake3

import ckptvault as cv
from ckptvault.events import Event, Replicated
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.layout import generation_dirname
from ckptvault.storage import S3Options, open_store
from support.common import writable

PLANTED_STEP = 10**11


@pytest.fixture(params=["dir", "s3"])
def replica(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The durable tier: a local directory, or a prefix of a fresh bucket on moto."""
    if request.param == "dir":
        return str(tmp_path / "remote")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/run"


def manager(local: Path, replica: str, keys: Path, **kwargs) -> cv.CheckpointManager:
    return cv.CheckpointManager(
        local,
        run_id="r",
        keystore=keys,
        replicate_to=replica,
        replica_retention=cv.Retention(keep_last=2, delete_delay=0),
        **kwargs,
    )


def weights(step: int) -> dict:
    return {"w": torch.full((16,), float(step)), "meta": {"step": step}}


def replica_steps(replica: str) -> list[int]:
    store = open_store(replica, s3=S3Options() if replica.startswith("s3://") else None)
    return sorted((ref.step for ref in store.list_generations()), reverse=True)


def plant_plaintext(local: Path, tmp_path: Path) -> Path:
    """A plaintext generation of run 'r' at a huge step, made with ckptvault by
    someone without the run's key, moved into the local tier."""
    elsewhere = tmp_path / "attacker"
    with cv.CheckpointManager(elsewhere, run_id="r") as evil:
        made = evil.save(PLANTED_STEP, {"w": torch.zeros(16), "meta": {"x": "evil"}}).result()
    planted = local / Path(made.path).name
    shutil.move(made.path, planted)
    return planted


def plant_relabelled(local: Path) -> Path:
    """A genuine encrypted generation copied under a huge step: encrypted throughout,
    only ``step`` edited and the self-digest recomputed (no key needed for that)."""
    genuine = min(p for p in local.iterdir() if p.name.startswith("step-"))
    document = json.loads((genuine / "manifest.json").read_bytes())
    document["step"] = PLANTED_STEP
    planted = local / generation_dirname(PLANTED_STEP, document["generation_id"])
    shutil.copytree(genuine, planted)
    planted.chmod(0o755)
    document.pop("manifest_blake3")
    document["manifest_blake3"] = blake3(dumps_canonical(document)).hexdigest()
    writable(planted / "manifest.json").write_bytes(dumps_canonical(document))
    return planted


def first_run(local: Path, replica: str, keys: Path, **kwargs) -> None:
    with manager(local, replica, keys, **kwargs) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, weights(step))
        assert mgr.replicator is not None
        mgr.replicator.wait()
    assert replica_steps(replica) == [30, 20]


def second_run(local: Path, replica: str, keys: Path, **kwargs) -> tuple[list[Event], int]:
    """The next process: one save, whose catch-up looks at what the local tier holds.
    Returns the Replicated events and the replicator's failure count."""
    with manager(local, replica, keys, **kwargs) as mgr:
        seen: list[Event] = []
        mgr.events.subscribe(seen.append)
        mgr.save(40, weights(40))
        assert mgr.replicator is not None
        mgr.replicator.wait()
        failures = mgr.replicator.status().failures
        restored = mgr.restore({"w": torch.zeros(16), "meta": {}})
        assert restored is not None and restored.step == 40
    return [e for e in seen if isinstance(e, Replicated)], failures


def test_catch_up_copies_only_what_the_ledger_saw_published(tmp_path: Path, replica: str):
    local, keys, ledger = tmp_path / "local", tmp_path / "keys", tmp_path / "ledger.db"
    first_run(local, replica, keys, ledger=ledger)
    plant_plaintext(local, tmp_path)
    plant_relabelled(local)
    replicated, failures = second_run(local, replica, keys, ledger=ledger)
    # Never even tried: neither planted generation was published by this run.
    assert failures == 0
    assert [e.step for e in replicated] == [40]
    assert replica_steps(replica) == [40, 30]  # the genuine generations stay


def test_catch_up_refuses_a_planted_plaintext_generation_without_a_ledger(
    tmp_path: Path, replica: str, caplog: pytest.LogCaptureFixture
):
    local, keys = tmp_path / "local", tmp_path / "keys"
    first_run(local, replica, keys)
    plant_plaintext(local, tmp_path)
    with caplog.at_level(logging.ERROR, logger="ckptvault"):
        replicated, failures = second_run(local, replica, keys)
    assert failures == 1
    assert "not-encrypted" in caplog.text
    assert [e.step for e in replicated] == [40]  # the planted copy never counted
    assert replica_steps(replica) == [40, 30]


def test_catch_up_refuses_a_relabelled_generation_without_a_ledger(
    tmp_path: Path, replica: str, caplog: pytest.LogCaptureFixture
):
    local, keys = tmp_path / "local", tmp_path / "keys"
    first_run(local, replica, keys)
    plant_relabelled(local)  # encrypted throughout; only its MAC gives it away
    with caplog.at_level(logging.ERROR, logger="ckptvault"):
        replicated, failures = second_run(local, replica, keys)
    assert failures == 1
    assert "manifest-unauthenticated" in caplog.text
    assert [e.step for e in replicated] == [40]
    assert replica_steps(replica) == [40, 30]
