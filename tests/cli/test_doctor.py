"""``ckptvault doctor``: each weakness in where things live and who can write them is
reported with what to fix, and a deployment without them passes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.cli import main
from ckptvault.trust.keystore import LocalKeyStore
from ckptvault.trust.signing import generate_keypair
from support.s3_server import new_bucket, s3_client


def _doctor(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, dict]]:
    code = main(["doctor", *args, "--json"])
    findings = json.loads(capsys.readouterr().out)
    return code, {f["check"]: f for f in findings}


@pytest.fixture
def deployment(tmp_path: Path) -> dict[str, Path]:
    """A store, ledger, audit log and key store laid out as the README says."""
    state = tmp_path / "state"
    places = {"store": tmp_path / "store", "ledger": state / "ledger.sqlite3"}
    with cv.CheckpointManager(places["store"], run_id="r", ledger=places["ledger"]) as mgr:
        mgr.save(1, {"x": torch.ones(3)})
    os.chmod(places["store"], 0o700)
    return places


def _args(places: dict[str, Path], *extra: str) -> list[str]:
    return [str(places["store"]), "--ledger", str(places["ledger"]), *extra]


def test_a_careful_deployment_passes(capsys, deployment):
    code, found = _doctor(capsys, *_args(deployment))
    assert code == 0
    for check in ("store permissions", "ledger permissions", "audit log permissions"):
        assert found[check]["status"] == "ok", found[check]
    assert found["store free space"]["status"] in ("ok", "warn")
    # The ledger and the audit log are created owner-only.
    assert oct(deployment["ledger"].stat().st_mode & 0o777) == "0o600"


def test_a_store_anyone_can_write_fails_and_says_how_to_fix_it(capsys, deployment):
    os.chmod(deployment["store"], 0o1777)  # even with the sticky bit: planting is possible
    code, found = _doctor(capsys, *_args(deployment))
    assert code == 1
    assert found["store permissions"]["status"] == "fail"
    assert "chmod o-w" in found["store permissions"]["fix"]


def test_a_group_writable_store_is_a_warning_and_strict_fails_on_it(capsys, deployment):
    os.chmod(deployment["store"], 0o770)
    code, found = _doctor(capsys, *_args(deployment))
    assert code == 0 and found["store permissions"]["status"] == "warn"
    code, _ = _doctor(capsys, *_args(deployment, "--strict"))
    assert code == 1


def test_a_ledger_others_can_write_or_inside_the_store_fails(capsys, deployment):
    os.chmod(deployment["ledger"], 0o666)
    code, found = _doctor(capsys, *_args(deployment))
    assert code == 1 and found["ledger permissions"]["status"] == "fail"
    inside = deployment["store"] / "ledger.sqlite3"
    inside.write_bytes(deployment["ledger"].read_bytes())
    code, found = _doctor(capsys, str(deployment["store"]), "--ledger", str(inside))
    assert code == 1 and found["ledger location"]["status"] == "fail"
    assert "inside the store" in found["ledger location"]["detail"]


def test_keys_readable_by_others_fail_and_keys_beside_the_data_warn(capsys, deployment, tmp_path):
    keys = tmp_path / "keys"
    LocalKeyStore(keys)
    with cv.CheckpointManager(tmp_path / "enc", run_id="e", keystore=keys) as mgr:
        mgr.save(1, {"x": torch.ones(3)})
    code, found = _doctor(capsys, *_args(deployment, "--keystore", str(keys)))
    assert found["key store permissions"]["status"] == "ok"
    assert found["key store volume"]["status"] == "warn"  # tmp_path holds both
    os.chmod(keys, 0o755)
    code, found = _doctor(capsys, *_args(deployment, "--keystore", str(keys)))
    assert code == 1 and found["key store permissions"]["status"] == "fail"


def test_a_signing_key_readable_by_others_fails(capsys, deployment, tmp_path):
    private = tmp_path / "signing.pem"
    generate_keypair(private, tmp_path / "signing.pub")
    code, found = _doctor(capsys, *_args(deployment, "--signing-key", str(private)))
    assert found["signing key permissions"]["status"] == "ok"
    os.chmod(private, 0o644)
    code, found = _doctor(capsys, *_args(deployment, "--signing-key", str(private)))
    assert code == 1 and found["signing key permissions"]["status"] == "fail"


def test_s3_bucket_protections_and_credentials(capsys, s3_endpoint, tmp_path, monkeypatch):
    ledger = ["--ledger", str(tmp_path / "state" / "ledger.sqlite3")]
    plain = new_bucket(s3_endpoint)
    with cv.CheckpointManager(f"s3://{plain}/run", run_id="r") as mgr:
        mgr.save(1, {"x": torch.ones(3)})
    code, found = _doctor(capsys, f"s3://{plain}/run", *ledger)
    assert code == 1 and found["bucket public access block"]["status"] == "fail"
    assert found["bucket versioning"]["status"] == "warn"
    assert found["bucket object lock"]["status"] == "warn"
    assert found["S3 credentials"]["status"] == "warn"  # static keys, no session token

    locked = new_bucket(s3_endpoint, object_lock=True)
    client = s3_client(s3_endpoint)
    client.put_public_access_block(
        Bucket=locked,
        PublicAccessBlockConfiguration={
            flag: True
            for flag in (
                "BlockPublicAcls",
                "IgnorePublicAcls",
                "BlockPublicPolicy",
                "RestrictPublicBuckets",
            )
        },
    )
    client.put_bucket_versioning(Bucket=locked, VersioningConfiguration={"Status": "Enabled"})
    client.put_bucket_encryption(
        Bucket=locked,
        ServerSideEncryptionConfiguration={
            "Rules": [{"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "aws:kms"}}]
        },
    )
    with cv.CheckpointManager(f"s3://{locked}/run", run_id="r") as mgr:
        mgr.save(1, {"x": torch.ones(3)})
    monkeypatch.setenv("AWS_SESSION_TOKEN", "a-temporary-token")
    code, found = _doctor(capsys, f"s3://{locked}/run", *ledger)
    assert code == 0, found
    for check in (
        "bucket public access block",
        "bucket versioning",
        "bucket object lock",
        "bucket default encryption",
        "S3 credentials",
    ):
        assert found[check]["status"] == "ok", found[check]
