"""The AWS KMS key store against moto's KMS on loopback (the session's S3 server
serves KMS on the same endpoint; credentials are fake): wrapping bound to its
context, keys per run, crypto-erase, encrypted runs end to end, and key rotation
on a local and an S3 store."""

from __future__ import annotations

import base64
import json
import secrets
import tempfile
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
import torch
from blake3 import blake3

import ckptvault as cv
from ckptvault.errors import KeyDestroyedError, KeyServiceError, KeyUnavailableError, UsageError
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME
from ckptvault.ops.rotation.rotate import ALREADY_ROTATED, NOT_REACHED, ROTATED, rotate_run_key
from ckptvault.trust.keystore import RotatingKeyStore
from ckptvault.trust.keystores import open_keystore
from ckptvault.trust.kms.keystore import (
    DEFAULT_ALIAS_PREFIX,
    TAG_DESTROYED,
    TAG_RUN_HASH,
    KmsKeyStore,
)
from ckptvault.trust.signing import generate_keypair
from support.common import run_cli
from support.s3_server import s3_client

SEGMENT = 4096


def kms_client(endpoint: str) -> Any:
    import boto3

    return boto3.session.Session().client("kms", endpoint_url=endpoint)


@pytest.fixture
def kms_url(s3_endpoint: str) -> str:
    """A per-run KMS key store under an alias prefix of its own (moto's KMS keeps
    its keys for the whole session)."""
    return f"kms://alias/ckv-{secrets.token_hex(6)}/?pending_window_days=7"


def tensors(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(40, 25, generator=generator), "b": torch.arange(step * 7.0)}


def save_run(store: str | Path, keystore: str, steps=(1, 2, 3), **options: Any) -> None:
    with cv.CheckpointManager(
        store, run_id="r", keystore=keystore, segment_size=SEGMENT, **options
    ) as mgr:
        for step in steps:
            mgr.save(step, tensors(step))


def restore_each(store: str | Path, keystore: str, steps=(1, 2, 3), **options: Any) -> None:
    # Each step is restored on purpose (allow_rollback_to) against a scratch ledger of
    # its own: with trusted keys an older step is a rollback, and this only checks
    # that every generation still reads; the run's own floor stays as it was.
    for step in steps:
        with (
            tempfile.TemporaryDirectory() as scratch,
            cv.CheckpointManager(
                store, run_id="r", keystore=keystore, ledger=Path(scratch) / "l", **options
            ) as mgr,
        ):
            state = {"w": torch.zeros(40, 25), "b": torch.zeros(step * 7)}
            info = mgr.restore(state, allow_rollback_to=step)
            assert info is not None and info.step == step and not info.skipped
            for name, tensor in tensors(step).items():
                assert torch.equal(state[name], tensor), (step, name)


def key_state(endpoint: str, key: str) -> dict[str, Any]:
    return kms_client(endpoint).describe_key(KeyId=key)["KeyMetadata"]


# -- URLs (no server needed) ---------------------------------------------------------


def test_kms_urls_choose_per_run_keys_or_one_shared_key():
    default = KmsKeyStore.from_url("kms://")
    assert default.key_id is None and default.alias_prefix == DEFAULT_ALIAS_PREFIX
    assert default.pending_window_days == 30 and default.location == "kms://alias/ckptvault/"
    prefixed = KmsKeyStore.from_url("kms://alias/team/ckpt/?region=eu-west-1&pending_window_days=7")
    assert (prefixed.key_id, prefixed.alias_prefix) == (None, "alias/team/ckpt/")
    assert (prefixed.region, prefixed.pending_window_days) == ("eu-west-1", 7)
    assert KmsKeyStore.from_url(prefixed.location).location == prefixed.location
    shared = KmsKeyStore.from_url("kms://alias/shared-ckpt-key")
    assert shared.key_id == "alias/shared-ckpt-key"
    arn = "arn:aws:kms:us-east-1:123456789012:key/1234abcd-12ab-34cd-56ef-1234567890ab"
    assert KmsKeyStore.from_url(f"kms://{arn}").key_id == arn
    assert isinstance(open_keystore("kms://"), KmsKeyStore)
    assert isinstance(open_keystore("kms://"), RotatingKeyStore)
    for bad in (
        "kms://?colour=blue",
        "kms://?pending_window_days=3",
        "kms://?pending_window_days=31",
        "kms://alias/aws/",
        "kms://alias/no spaces/",
    ):
        with pytest.raises(UsageError):
            KmsKeyStore.from_url(bad)


def test_an_unreachable_key_service_is_a_service_error_not_a_bad_key():
    import boto3
    from botocore.config import Config

    client = boto3.session.Session().client(
        "kms",
        region_name="us-east-1",
        endpoint_url="http://127.0.0.1:9",
        aws_access_key_id="x",
        aws_secret_access_key="y",
        config=Config(retries={"max_attempts": 1}, connect_timeout=1),
    )
    keystore = KmsKeyStore(client=client)
    with pytest.raises(KeyServiceError, match="network"):
        keystore.wrap("r", b"k" * 32, b"context")


# -- wrapping -------------------------------------------------------------------------


def test_wrap_unwrap_is_bound_to_run_and_context(kms_url: str, s3_endpoint: str):
    keystore = open_keystore(kms_url)
    assert isinstance(keystore, KmsKeyStore)
    kek_id, wrapped = keystore.wrap("run/42", b"k" * 32, b"file a")
    assert kek_id.startswith("arn:aws:kms:") and b"k" * 32 not in wrapped
    assert keystore.unwrap("run/42", kek_id, wrapped, b"file a") == b"k" * 32
    # Another file's context, another run, an edited blob: refused, typed.
    with pytest.raises(KeyUnavailableError, match="does not open"):
        keystore.unwrap("run/42", kek_id, wrapped, b"file b")
    with pytest.raises(KeyUnavailableError, match="not a key of run"):
        keystore.unwrap("run/43", kek_id, wrapped, b"file a")
    edited = bytearray(wrapped)
    edited[-1] ^= 1
    with pytest.raises(KeyUnavailableError):
        keystore.unwrap("run/42", kek_id, bytes(edited), b"file a")
    with pytest.raises(KeyUnavailableError, match="not a KMS key ARN"):
        keystore.unwrap("run/42", "kek-planted", wrapped, b"file a")
    # The run got its own key: found by its alias, tagged with its run hash.
    metadata = key_state(s3_endpoint, keystore.alias_of("run/42"))
    assert metadata["Arn"] == kek_id and metadata["KeyState"] == "Enabled"
    tags = kms_client(s3_endpoint).list_resource_tags(KeyId=kek_id)["Tags"]
    assert {"TagKey": TAG_RUN_HASH, "TagValue": blake3(b"run/42").hexdigest()} in tags
    assert keystore.alias_of("run/42").startswith(keystore.alias_prefix + "run_42-")
    # A second run gets a second key; the first key is reused, not duplicated.
    other, _ = keystore.wrap("run/43", b"k" * 32, b"file a")
    assert other != kek_id and keystore.wrap("run/42", b"j" * 32, b"x")[0] == kek_id


def test_a_key_of_another_run_named_in_a_manifest_is_refused(kms_url: str):
    """Whoever writes the store could name a key the trainer may use but that is not
    the run's: its wrapped MAC key would let them forge manifests."""
    keystore = open_keystore(kms_url)
    foreign_kek, foreign_wrapped = keystore.wrap("attacker-run", b"m" * 32, b"the context")
    keystore.wrap("victim", b"v" * 32, b"warm up")
    with pytest.raises(KeyUnavailableError, match="not a key of run 'victim'"):
        keystore.unwrap("victim", foreign_kek, foreign_wrapped, b"the context")


def test_one_shared_key_for_every_run(s3_endpoint: str):
    key = kms_client(s3_endpoint).create_key(Description="shared")["KeyMetadata"]
    keystore = open_keystore(f"kms://{key['Arn']}")
    kek_id, wrapped = keystore.wrap("a", b"k" * 32, b"ctx")
    assert kek_id == key["Arn"]
    assert keystore.unwrap("a", kek_id, wrapped, b"ctx") == b"k" * 32
    with pytest.raises(KeyUnavailableError):  # bound to the run id all the same
        keystore.unwrap("b", kek_id, wrapped, b"ctx")
    other = kms_client(s3_endpoint).create_key(Description="other")["KeyMetadata"]["Arn"]
    with pytest.raises(KeyUnavailableError, match="not the key"):
        keystore.unwrap("a", other, wrapped, b"ctx")
    with pytest.raises(UsageError, match="every run"):
        keystore.destroy("a")
    assert isinstance(keystore, KmsKeyStore)
    with pytest.raises(UsageError, match="automatic rotation"):
        keystore.begin_rotation("a")


# -- crypto-erase ---------------------------------------------------------------------


def test_destroy_tombstones_disables_and_schedules_deletion(kms_url: str, s3_endpoint: str):
    keystore = open_keystore(kms_url)
    assert isinstance(keystore, KmsKeyStore)
    kek_id, wrapped = keystore.wrap("doomed", b"k" * 32, b"ctx")
    keystore.wrap("kept", b"k" * 32, b"ctx")

    info = keystore.destroy("doomed")

    assert info.kek_id == kek_id and info.destroyed_at and info.deleted_after
    for call in (
        lambda: keystore.ensure_usable("doomed"),
        lambda: keystore.wrap("doomed", b"k" * 32, b"ctx"),
        lambda: keystore.unwrap("doomed", kek_id, wrapped, b"ctx"),
    ):
        with pytest.raises(KeyDestroyedError, match="destroyed"):
            call()
    metadata = key_state(s3_endpoint, kek_id)
    assert metadata["KeyState"] == "PendingDeletion" and not metadata["Enabled"]
    deletion = metadata["DeletionDate"]
    soon = datetime.now(timezone.utc) + timedelta(days=7)
    assert abs((deletion - soon).total_seconds()) < 600  # the configured 7-day window
    tags = kms_client(s3_endpoint).list_resource_tags(KeyId=kek_id)["Tags"]
    assert any(tag["TagKey"] == TAG_DESTROYED for tag in tags)
    # The tombstone is an alias on a marker key that outlives the run's key.
    tombstone = key_state(s3_endpoint, keystore.tombstone_alias_of("doomed"))
    assert tombstone["Arn"] != kek_id and tombstone["KeyState"] == "Disabled"
    assert keystore.destroy("doomed").kek_id == kek_id  # idempotent
    keystore.ensure_usable("kept")  # other runs are untouched
    listed = {info.run_id: info for info in keystore.list_keys()}
    assert listed["doomed"].destroyed_at and listed["kept"].destroyed_at is None


# -- encrypted runs end to end --------------------------------------------------------


def test_encrypted_save_and_restore_with_kms(kms_url: str, store: Path, tmp_path: Path):
    save_run(store, kms_url)
    generation = next(store.glob("step-*"))
    manifest = json.loads((generation / MANIFEST_NAME).read_bytes())
    assert manifest["encryption"]["kek_id"].startswith("arn:aws:kms:")
    restore_each(store, kms_url)
    # A wrapped key moved to another file of the generation does not open.
    section = manifest["encryption"]
    names = sorted(section["files"])
    assert len(names) >= 2
    keystore = open_keystore(kms_url)
    moved = base64.b64decode(section["files"][names[0]]["wrapped_key"])
    from ckptvault.trust.envelope import binding

    with pytest.raises(KeyUnavailableError):
        keystore.unwrap(
            "r", section["kek_id"], moved, binding("r", manifest["generation_id"], names[1])
        )

    listing = run_cli("keys", "list", "--keystore", kms_url, "--json")
    assert listing.returncode == 0, listing.stderr
    assert [entry["run_id"] for entry in json.loads(listing.stdout)] == ["r"]
    erased = run_cli("keys", "destroy", "--keystore", kms_url, "--run", "r", "--yes")
    assert erased.returncode == 0, erased.stderr
    assert "deletes the key material after" in erased.stdout
    with cv.CheckpointManager(store, run_id="r", keystore=kms_url) as mgr:
        with pytest.raises(KeyDestroyedError):
            mgr.restore({"w": torch.zeros(40, 25), "b": torch.zeros(21)})
        with pytest.raises(KeyDestroyedError):
            mgr.save(9, tensors(9))


# -- rotation -------------------------------------------------------------------------


def data_digests(store: Path) -> dict[str, tuple[int, int, str]]:
    found = {}
    for generation in sorted(store.glob("step-*")):
        for path in sorted(generation.iterdir()):
            if path.name not in (MANIFEST_NAME, SIGNATURE_NAME):
                info = path.stat()
                digest = blake3(path.read_bytes()).hexdigest()
                found[f"{generation.name}/{path.name}"] = (info.st_ino, info.st_mtime_ns, digest)
    return found


def kek_ids(store: Path) -> set[str]:
    return {
        json.loads((g / MANIFEST_NAME).read_bytes())["encryption"]["kek_id"]
        for g in store.glob("step-*")
    }


def test_kms_rotation_on_a_local_store(kms_url: str, store: Path, s3_endpoint: str):
    save_run(store, kms_url)
    (old_kek,) = kek_ids(store)
    before = data_digests(store)

    interrupted = rotate_run_key(store, "r", kms_url, stop_after=2)
    assert (interrupted.count(ROTATED), interrupted.count(NOT_REACHED)) == (2, 1)
    assert key_state(s3_endpoint, old_kek)["KeyState"] == "Enabled"  # still needed
    restore_each(store, kms_url)  # both keys unwrap meanwhile

    result = run_cli("keys", "rotate", "--keystore", kms_url, "--run", "r", "--store", str(store))
    assert result.returncode == 0, result.stderr + result.stdout
    assert "resumed" in result.stdout and "finished" in result.stdout

    assert kek_ids(store) == {interrupted.new_kek_id}
    assert data_digests(store) == before
    assert key_state(s3_endpoint, old_kek)["KeyState"] == "PendingDeletion"
    assert key_state(s3_endpoint, open_keystore(kms_url).alias_of("r"))["Arn"] == (
        interrupted.new_kek_id
    )
    restore_each(store, kms_url)
    with pytest.raises(KeyUnavailableError, match="PendingDeletion"):
        keystore = open_keystore(kms_url)
        keystore.unwrap("r", old_kek, b"x" * 40, b"ctx")


@pytest.mark.heavy
def test_kms_rotation_of_a_signed_run_on_s3(
    kms_url: str, s3_bucket: str, s3_endpoint: str, tmp_path: Path
):
    private, public = tmp_path / "k.pem", tmp_path / "k.pub"
    generate_keypair(private, public)
    url = f"s3://{s3_bucket}/run"
    save_run(url, kms_url, signing_key=private, trusted_keys=[public])
    s3 = s3_client(s3_endpoint)

    def objects() -> dict[str, str]:
        listed = s3.list_objects_v2(Bucket=s3_bucket, Prefix="run/")["Contents"]
        return {o["Key"]: o["ETag"] for o in listed if not o["Key"].startswith("run/.")}

    before = objects()
    with pytest.raises(UsageError, match="signing-key"):
        rotate_run_key(url, "r", kms_url)
    assert objects() == before

    report = rotate_run_key(url, "r", kms_url, signing_key=private)
    assert report.finished and report.count(ROTATED) == 3

    after = objects()
    data = [key for key in before if "/data/" in key]
    assert data and all(after[key] == before[key] for key in data)  # untouched
    changed = sorted(key for key in before if after[key] != before[key])
    assert changed and all(key.endswith((MANIFEST_NAME, SIGNATURE_NAME)) for key in changed)
    verified = run_cli("verify", url, "--all", "--trusted-key", str(public))
    assert verified.returncode == 0, verified.stdout + verified.stderr
    restore_each(url, kms_url, trusted_keys=[public])
    again = rotate_run_key(url, "r", kms_url, signing_key=private)
    assert again.finished and again.count(ROTATED) == 3 and again.count(ALREADY_ROTATED) == 0


def test_destroying_a_run_mid_rotation_schedules_both_keys(kms_url: str, s3_endpoint: str):
    keystore = open_keystore(kms_url)
    assert isinstance(keystore, KmsKeyStore)
    old_kek, wrapped = keystore.wrap("r", b"k" * 32, b"ctx")
    rotation = keystore.begin_rotation("r")
    assert rotation.retired_kek_ids == (old_kek,) and rotation.new_kek_id != old_kek
    assert keystore.begin_rotation("r").resumed
    assert keystore.unwrap("r", old_kek, wrapped, b"ctx") == b"k" * 32  # still unwraps
    keystore.destroy("r")
    for key in (old_kek, rotation.new_kek_id):
        assert key_state(s3_endpoint, key)["KeyState"] == "PendingDeletion"
    with pytest.raises(KeyDestroyedError):
        keystore.unwrap("r", old_kek, wrapped, b"ctx")
