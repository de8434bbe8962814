"""Versioned buckets and Object Lock: GC deletes every version of a generation, keeps
a generation under retention ("locked until DATE"), and reports versions it may not
delete as retained copies; ``object_lock_days`` locks milestones and pins only.

Each test runs on moto and on SeaweedFS (``each_s3_endpoint``), S3-protocol servers
on loopback. moto's GetObjectRetention answers 500, so retention is read the way
ckptvault reads it, from HEAD (``ObjectLockRetainUntilDate``, ``ObjectLockLegalHoldStatus``).
"""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import torch

import ckptvault as cv
from ckptvault.format.layout import MANIFEST_NAME
from ckptvault.storage import open_store
from ckptvault.storage.records import DELETION_MARK
from ckptvault.storage.retained import RetainingStore
from ckptvault.storage.s3.store import S3Store
from support.common import run_cli
from support.s3_server import new_bucket, s3_client

TENSOR_FILE = "r00000-000.safetensors"


def s3_store(url: str) -> S3Store:
    store = open_store(url)
    assert isinstance(store, S3Store) and isinstance(store, RetainingStore)
    return store


def save_steps(url: str, steps: range | tuple[int, ...], **options: Any) -> dict[int, str]:
    """Save each step; generation id by step."""
    with cv.CheckpointManager(url, run_id="run42", **options) as mgr:
        return {
            step: mgr.save(step, {"w": torch.full((64,), float(step))}).result().generation_id
            for step in steps
        }


def versions_of(endpoint: str, bucket: str, generation_id: str) -> list[dict]:
    """Every version and delete marker of any object of that generation."""
    raw = s3_client(endpoint).list_object_versions(Bucket=bucket, Prefix="run42/")
    found = [*raw.get("Versions", []), *raw.get("DeleteMarkers", [])]
    return [v for v in found if generation_id in v["Key"]]


def lock_of(store: S3Store, key: str) -> datetime | None:
    head = store.client.raw.head_object(Bucket=store.client.bucket, Key=key)
    until = head.get("ObjectLockRetainUntilDate")
    return until if isinstance(until, datetime) else None


def manifest_key(store: S3Store, step: int) -> str:
    ref = next(ref for ref in store.list_generations() if ref.step == step)
    return store.layout.generation_key(ref.name, MANIFEST_NAME)


def gc(url: str, *args: str) -> tuple[int, dict]:
    result = run_cli("gc", url, "--json", *args)
    assert result.stdout, result.stderr
    return result.returncode, json.loads(result.stdout)


def test_retention_in_a_versioned_bucket_deletes_every_version(each_s3_endpoint: str):
    bucket = new_bucket(each_s3_endpoint)
    s3_client(each_s3_endpoint).put_bucket_versioning(
        Bucket=bucket, VersioningConfiguration={"Status": "Enabled"}
    )
    url = f"s3://{bucket}/run42"
    ids = save_steps(url, range(1, 5), retention=cv.Retention(keep_last=1, delete_delay=0))
    assert [ref.step for ref in s3_store(url).list_generations()] == [4, 3]
    for step in (1, 2):  # no noncurrent version, no delete marker: nothing of them is left
        assert versions_of(each_s3_endpoint, bucket, ids[step]) == [], step
    assert versions_of(each_s3_endpoint, bucket, ids[4])  # (the listing does find what exists)


def test_object_lock_days_locks_milestones_and_pins_only(each_s3_endpoint: str):
    bucket = new_bucket(each_s3_endpoint, object_lock=True)
    url = f"s3://{bucket}/run42"
    retention = cv.Retention(keep_last=1, keep_every=2, delete_delay=0)
    ids = save_steps(url, range(1, 6), retention=retention, object_lock_days=1)
    store = s3_store(url)
    assert [ref.step for ref in store.list_generations()] == [5, 4, 2]
    soon = time.time() + 3600
    for step in (2, 4):  # milestones: every object locked, manifest included
        until = lock_of(store, manifest_key(store, step))
        assert until is not None and until.timestamp() > soon, step
        data = lock_of(store, store.layout.data_key(ids[step], TENSOR_FILE))
        assert data is not None and data.timestamp() > soon, step
    assert lock_of(store, manifest_key(store, 5)) is None  # not a milestone
    assert lock_of(store, store.layout.data_key(ids[5], TENSOR_FILE)) is None
    for step in (1, 3):  # dropped, unlocked: deleted with every version
        assert versions_of(each_s3_endpoint, bucket, ids[step]) == [], step

    # A pin locks the generation it pins (the manager's store has object_lock_days).
    with cv.CheckpointManager(url, run_id="run42", object_lock_days=1) as mgr:
        mgr.pin(5)
    until = lock_of(store, manifest_key(store, 5))
    assert until is not None and until.timestamp() > soon
    assert lock_of(store, store.layout.data_key(ids[5], TENSOR_FILE)) is not None


def test_gc_keeps_a_locked_generation_and_does_not_fail(each_s3_endpoint: str):
    bucket = new_bucket(each_s3_endpoint, object_lock=True)
    url = f"s3://{bucket}/run42"
    save_steps(url, (1, 2, 3), object_lock_days=1)  # no retention policy: every one locked
    code, report = gc(url, "--keep-last", "1", "--delete-delay", "0s")
    assert code == 0, report
    decisions = {d["step"]: d for d in report["decisions"]}
    assert decisions[1]["action"] == "keep"
    [reason] = decisions[1]["reasons"]
    assert reason.startswith("locked until 20") and reason.endswith("Z")
    assert decisions[3]["reasons"][0] == "newest verified"
    assert report["failed"] == [] and report["retained_copies"] == []
    assert [ref.step for ref in s3_store(url).list_generations()] == [3, 2, 1]
    text = run_cli("gc", url, "--keep-last", "1", "--delete-delay", "0s")
    assert text.returncode == 0, text.stdout + text.stderr
    assert "keep    locked until" in text.stdout


def test_the_managers_retention_keeps_a_locked_generation(each_s3_endpoint: str):
    bucket = new_bucket(each_s3_endpoint, object_lock=True)
    url = f"s3://{bucket}/run42"
    retention = cv.Retention(keep_last=1, delete_delay=0)
    with cv.CheckpointManager(url, run_id="run42", retention=retention, object_lock_days=1) as mgr:
        mgr.save(1, {"w": torch.ones(8)})
        mgr.pin(1)  # locked for a day
        mgr.unpin(1)  # the pin goes, the lock stays
        for step in (2, 3):
            mgr.save(step, {"w": torch.full((8,), float(step))})
        assert mgr.retention is not None and mgr.retention.last_plan is not None
        decision = next(d for d in mgr.retention.last_plan.decisions if d.step == 1)
    assert decision.action == "keep" and decision.reasons[0].startswith("locked until ")
    assert [ref.step for ref in s3_store(url).list_generations()] == [3, 2, 1]


def test_versions_that_may_not_be_deleted_are_reported_as_retained_copies(each_s3_endpoint: str):
    bucket = new_bucket(each_s3_endpoint, object_lock=True)
    url = f"s3://{bucket}/run42"
    ids = save_steps(url, (1, 2, 3, 4))  # nothing locked by ckptvault
    store = s3_store(url)
    held, locked = (store.layout.data_key(ids[step], TENSOR_FILE) for step in (1, 2))
    raw = s3_client(each_s3_endpoint)
    raw.put_object_legal_hold(Bucket=bucket, Key=held, LegalHold={"Status": "ON"})
    until = datetime.now(timezone.utc) + timedelta(days=1)
    lock = {"Mode": "GOVERNANCE", "RetainUntilDate": until}
    raw.put_object_retention(Bucket=bucket, Key=locked, Retention=lock)

    code, report = gc(url, "--keep-last", "1", "--delete-delay", "0s")
    assert code == 0, report  # retained copies are not failures
    outcomes = {d["step"]: (d["action"], d["outcome"]) for d in report["decisions"]}
    assert outcomes[1] == ("delete", "deleted; 1 copy retained (under legal hold)")
    assert outcomes[2][0] == "delete" and outcomes[2][1].startswith(
        "deleted; 1 copy retained (locked until 20"
    )
    copies = {copy["step"]: copy for copy in report["retained_copies"]}
    assert sorted(copies) == [1, 2] and report["failed"] == []
    assert copies[1]["generation_id"] == ids[1] and copies[1]["version_id"]
    assert copies[1]["location"] == f"s3://{bucket}/{held}"
    assert copies[1]["reason"] == "under legal hold"
    assert copies[2]["location"] == f"s3://{bucket}/{locked}"
    assert copies[2]["reason"].startswith("locked until ") and copies[2]["retain_until"]
    assert [ref.step for ref in store.list_generations()] == [4, 3]  # gone from listings
    names = sorted(f"step-00000000000{step}.{ids[step]}" for step in (1, 2))
    assert sorted(store.list_records(DELETION_MARK)) == names  # so later passes retry
    for step, key in ((1, held), (2, locked)):  # only that version stays, under a marker
        versions = [
            v
            for v in versions_of(each_s3_endpoint, bucket, ids[step])
            if "/.records/" not in v["Key"]
        ]
        assert {v["Key"] for v in versions} == {key}
        assert sorted(v["VersionId"] == copies[step]["version_id"] for v in versions) == [
            False,  # the delete marker on top: the object stays deleted
            True,
        ]

    text = run_cli("gc", url, "--keep-last", "1", "--delete-delay", "0s")
    assert text.returncode == 0, text.stdout + text.stderr
    assert f"retained copy of step 1: s3://{bucket}/{held}" in text.stdout
    assert "retained: 1 copy retained (under legal hold)" in text.stdout

    hold_off = {"Status": "OFF"}  # on the version: the current one is a delete marker now
    raw.put_object_legal_hold(
        Bucket=bucket, Key=held, VersionId=copies[1]["version_id"], LegalHold=hold_off
    )
    code, report = gc(url, "--keep-last", "1", "--delete-delay", "0s")
    assert code == 0, report
    finished = {d["step"]: d for d in report["decisions"] if not d["listed"]}
    assert finished[1]["outcome"] == "deleted"  # its last copy went, and its mark
    assert finished[2]["outcome"].startswith("retained: 1 copy retained (locked until ")
    assert [copy["step"] for copy in report["retained_copies"]] == [2]
    assert versions_of(each_s3_endpoint, bucket, ids[1]) == []
    assert list(store.list_records(DELETION_MARK)) == [names[1]]


def test_object_lock_days_reaches_an_s3_replica_of_a_local_store(each_s3_endpoint: str, tmp_path):
    bucket = new_bucket(each_s3_endpoint, object_lock=True)
    url = f"s3://{bucket}/run42"
    with cv.CheckpointManager(
        tmp_path / "local",
        run_id="run42",
        replicate_to=url,
        s3_endpoint_url=each_s3_endpoint,
        object_lock_days=1,
    ) as mgr:
        info = mgr.save(7, {"w": torch.ones(64)}).result()
    store = s3_store(url)
    until = lock_of(store, manifest_key(store, 7))  # no policy: every generation locked
    assert until is not None and until.timestamp() > time.time() + 3600
    assert lock_of(store, store.layout.data_key(info.generation_id, TENSOR_FILE)) is not None


def test_s3_options_without_an_s3_tier_are_refused(tmp_path):
    with pytest.raises(cv.errors.UsageError, match="s3://"):
        cv.CheckpointManager(tmp_path / "local", run_id="r", object_lock_days=1)
