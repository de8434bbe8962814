"""Checkpoints in an S3 store, end to end: the manager, the CLI, a killed save.

Against a real S3-protocol server on loopback (``s3_server.py``). The manager gets
its endpoint through ``s3_endpoint_url=`` and the CLI through ``--s3-endpoint-url``,
with ``AWS_ENDPOINT_URL`` removed, so those options are what reaches the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import StoreLockedError, UsageError
from ckptvault.format.layout import MANIFEST_NAME
from ckptvault.storage import S3Options, open_store
from ckptvault.storage.s3.store import S3Store
from ckptvault.trust.signing import generate_keypair
from support.common import assert_same_tensors, make_training_state, model_snapshot, train_steps
from support.s3_server import new_bucket, s3_client

WORKER = Path(__file__).resolve().parents[1] / "support" / "s3_crash_worker.py"
TENSOR_FILE = "r00000-000.safetensors"


@pytest.fixture
def explicit_endpoint(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """The endpoint, reachable only when passed explicitly."""
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    return s3_endpoint


def manager(url: str, endpoint: str, **kwargs: object) -> cv.CheckpointManager:
    return cv.CheckpointManager(url, run_id="run42", s3_endpoint_url=endpoint, **kwargs)


def s3_store(url: str, endpoint: str) -> S3Store:
    store = open_store(url, s3=S3Options(endpoint_url=endpoint))
    assert isinstance(store, S3Store)
    return store


def tamper(store: S3Store, generation_id: str, name: str) -> None:
    """Flip the last byte of a data object (same size, new bytes)."""
    raw, key = store.client.raw, store.layout.data_key(generation_id, name)
    body = bytearray(raw.get_object(Bucket=store.client.bucket, Key=key)["Body"].read())
    body[-1] ^= 0xFF
    raw.put_object(Bucket=store.client.bucket, Key=key, Body=bytes(body))


def cli(*args: str, endpoint: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "AWS_ENDPOINT_URL"}
    return subprocess.run(
        [sys.executable, "-m", "ckptvault", *args, "--s3-endpoint-url", endpoint],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_save_and_restore_round_trip(s3_bucket: str, explicit_endpoint: str):
    url = f"s3://{s3_bucket}/run42"
    state = make_training_state()
    with manager(url, explicit_endpoint) as mgr:
        train_steps(state, 3)
        expected = model_snapshot(state["model"])
        info = mgr.save(3, state).result()
        assert info.path == f"{url}/generations/step-000000000003.{info.generation_id}"
        train_steps(state, 2)  # diverge, then go back
        restored = mgr.restore(state)
        assert restored is not None and restored.step == 3
        assert_same_tensors(model_snapshot(state["model"]), expected)
        assert [g.step for g in mgr.generations()] == [3]
    keys = [
        o["Key"] for o in s3_client(explicit_endpoint).list_objects_v2(Bucket=s3_bucket)["Contents"]
    ]
    assert all(key.startswith("run42/") for key in keys)  # nothing outside the prefix
    data = [key for key in keys if key.startswith("run42/data/")]
    assert data and all(f"/{info.generation_id}/r00000-" in key for key in data)


def test_encrypted_and_signed_round_trip(s3_bucket: str, explicit_endpoint: str, tmp_path: Path):
    key_id = generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    trust = {"signing_key": tmp_path / "k.pem", "trusted_keys": [tmp_path / "k.pub"]}
    url = f"s3://{s3_bucket}/run42"
    state = make_training_state()
    with manager(url, explicit_endpoint, keystore=tmp_path / "keys", **trust) as mgr:
        train_steps(state, 2)
        expected = model_snapshot(state["model"])
        info = mgr.save(2, state).result()
        train_steps(state, 1)
        restored = mgr.restore(state)
    assert restored is not None and restored.signer == key_id
    assert_same_tensors(model_snapshot(state["model"]), expected)
    store = s3_store(url, explicit_endpoint)
    [ref] = store.list_generations()
    names = set(store.list_entries(ref))
    assert {"manifest.sig", "r00000-000.safetensors.enc", "r00000-state.json.enc"} <= names
    assert b"tokens_seen" not in store.read_bytes(ref, MANIFEST_NAME, 1 << 20)  # state is sealed
    assert info.generation_id == ref.generation_id


def test_tampered_and_missing_objects_are_refused_with_their_reasons(
    s3_bucket: str, explicit_endpoint: str
):
    url = f"s3://{s3_bucket}/run42"
    with manager(url, explicit_endpoint) as mgr:
        saved = {
            step: mgr.save(step, {"w": torch.full((64,), float(step))}).result()
            for step in (1, 2, 3)
        }
    store = s3_store(url, explicit_endpoint)
    tamper(store, saved[3].generation_id, TENSOR_FILE)
    key = store.layout.data_key(saved[2].generation_id, TENSOR_FILE)
    store.client.call("delete_object", key)
    state = {"w": torch.zeros(64)}
    with manager(url, explicit_endpoint) as mgr:
        info = mgr.restore(state)
    assert info is not None and info.step == 1 and torch.equal(state["w"], torch.ones(64))
    reasons = [(s.step, s.reason.split(":")[0]) for s in info.skipped]
    assert reasons == [(3, "digest-mismatch"), (2, "file-missing")]


def test_cli_verify_ls_and_inspect_on_an_s3_url(s3_bucket: str, explicit_endpoint: str):
    url = f"s3://{s3_bucket}/run42"
    with manager(url, explicit_endpoint) as mgr:
        info = mgr.save(7, {"w": torch.arange(32.0), "meta": {"epoch": 1}}).result()
    verified = cli("verify", url, endpoint=explicit_endpoint)
    assert verified.returncode == 0, verified.stderr
    listed = cli("ls", url, "--json", endpoint=explicit_endpoint)
    assert listed.returncode == 0, listed.stderr
    [entry] = json.loads(listed.stdout)
    assert (entry["step"], entry["generation_id"], entry["path"]) == (
        7,
        info.generation_id,
        info.path,
    )
    inspected = cli("inspect", url, "--json", endpoint=explicit_endpoint)
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["generation"]["step"] == 7

    tamper(s3_store(url, explicit_endpoint), info.generation_id, TENSOR_FILE)
    refused = cli("verify", url, endpoint=explicit_endpoint)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "digest-mismatch" in refused.stdout + refused.stderr
    missing = cli("ls", f"s3://ckv-no-such-bucket-{s3_bucket[4:]}/x", endpoint=explicit_endpoint)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_two_managers_on_one_store_cannot_both_publish(s3_bucket: str, explicit_endpoint: str):
    url = f"s3://{s3_bucket}/run42"
    with manager(url, explicit_endpoint) as first:
        first.save(1, {"w": torch.ones(4)})
        second = manager(url, explicit_endpoint)
        with pytest.raises(StoreLockedError, match=f"pid {os.getpid()}"):
            second.save(2, {"w": torch.ones(4)})
        first.save(3, {"w": torch.ones(4)})
    second.save(4, {"w": torch.ones(4)})  # the first one released the lease on close
    second.close()
    assert [ref.step for ref in s3_store(url, explicit_endpoint).list_generations()] == [4, 3, 1]


_RACER = """
import sys, torch, ckptvault as cv
from ckptvault.errors import StoreLockedError
with cv.CheckpointManager(sys.argv[1], run_id="run42") as mgr:
    sys.stdin.readline()  # start together
    try:
        mgr.save(int(sys.argv[2]), {"w": torch.ones(1 << 20)})
    except StoreLockedError:
        print("locked", flush=True)
        sys.exit(0)
    print("published", flush=True)
    sys.stdin.readline()  # hold the lease until the other one has tried
"""


@pytest.mark.timeout(180)
def test_two_processes_racing_to_publish_cannot_both_win(s3_bucket: str, s3_endpoint: str):
    url = f"s3://{s3_bucket}/run42"
    racers = [
        subprocess.Popen(
            [sys.executable, "-c", _RACER, url, str(step)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for step in (1, 2)
    ]
    for racer in racers:
        assert racer.stdin is not None
        racer.stdin.write("go\n")
        racer.stdin.flush()
    outcomes = [racer.stdout.readline().strip() for racer in racers if racer.stdout]
    for racer in racers:
        racer.communicate("done\n", timeout=120)
    assert sorted(outcomes) == ["locked", "published"]
    assert len(open_store(url).list_generations()) == 1


@pytest.mark.timeout(240)
def test_a_save_killed_mid_upload_leaves_no_generation(each_s3_bucket: str, each_s3_endpoint: str):
    url = f"s3://{each_s3_bucket}/crash"
    raw = s3_client(each_s3_endpoint)
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "saved 1"
        deadline = time.monotonic() + 120
        while _parts_uploaded(raw, each_s3_bucket) < 2:  # mid-way through step 2's upload
            assert time.monotonic() < deadline and worker.poll() is None, "no upload seen"
            time.sleep(0.05)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    store = open_store(url)
    [published] = store.list_generations()
    assert published.step == 1
    assert raw.list_multipart_uploads(Bucket=each_s3_bucket).get("Uploads")  # left by the kill

    state = {"w": torch.zeros(10)}
    with cv.CheckpointManager(url, run_id="crash") as mgr:
        info = mgr.restore(state)
        assert info is not None and info.step == 1 and torch.equal(state["w"], torch.arange(10.0))
        assert len(store.remove_stale_staging(0)) == 1  # the killed attempt
        assert not raw.list_multipart_uploads(Bucket=each_s3_bucket).get("Uploads")
        data = [
            o["Key"]
            for o in raw.list_objects_v2(Bucket=each_s3_bucket, Prefix="crash/data/")["Contents"]
        ]
        assert data and all(f"/{published.generation_id}/" in key for key in data)
        # The killed writer's lease does not block its restart on this machine.
        mgr.save(2, {"w": torch.ones(10)})
    assert [ref.step for ref in store.list_generations()] == [2, 1]


def _parts_uploaded(raw: object, bucket: str) -> int:
    uploads = raw.list_multipart_uploads(Bucket=bucket).get("Uploads", [])  # type: ignore[attr-defined]
    return sum(
        len(raw.list_parts(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]).get("Parts", []))  # type: ignore[attr-defined]
        for u in uploads
    )


def test_object_lock_retains_published_objects(s3_endpoint: str):
    bucket = new_bucket(s3_endpoint, object_lock=True)
    url = f"s3://{bucket}/run42"
    with manager(url, s3_endpoint, object_lock_days=3) as mgr:
        info = mgr.save(1, {"w": torch.ones(8)}).result()
    store = s3_store(url, s3_endpoint)
    [ref] = store.list_generations()
    for key in (
        store.layout.generation_key(ref.name, MANIFEST_NAME),
        store.layout.data_key(info.generation_id, TENSOR_FILE),
    ):
        head = store.client.call("head_object", key)
        assert head["ObjectLockMode"] == "GOVERNANCE", key
        assert head["ObjectLockRetainUntilDate"].timestamp() > time.time() + 2 * 86400

    unlocked = f"s3://{new_bucket(s3_endpoint)}/run42"
    with (
        manager(unlocked, s3_endpoint, object_lock_days=3) as mgr,
        pytest.raises(UsageError, match="does not have Object Lock enabled"),
    ):
        mgr.save(1, {"w": torch.ones(8)})
    assert s3_store(unlocked, s3_endpoint).list_generations() == []


def test_s3_options_for_a_local_store_are_refused(tmp_path: Path):
    with pytest.raises(UsageError, match="s3:// stores only"):
        cv.CheckpointManager(tmp_path / "store", run_id="r", s3_endpoint_url="http://127.0.0.1:9")
