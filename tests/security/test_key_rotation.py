"""Key rotation with a local key store: a new KEK, every generation re-wrapped, no
tensor file rewritten; resumable after an interruption or a crash; signed runs
re-signed (and refused without the signing key before anything changes)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch
from blake3 import blake3

import ckptvault as cv
from ckptvault.errors import KeyDestroyedError, KeyUnavailableError, StoreLockedError, UsageError
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME
from ckptvault.ops.rotation.rotate import (
    ALREADY_ROTATED,
    FAILED,
    NOT_REACHED,
    ROTATED,
    rotate_run_key,
)
from ckptvault.trust.keystore import LocalKeyStore
from ckptvault.trust.signing import MANIFEST_DOMAIN, generate_keypair, load_private_key, sign
from support.common import REPO, run_cli

SEGMENT = 4096
STEPS = (1, 2, 3)


def tensors(step: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, 33, generator=generator), "b": torch.arange(step * 10.0)}


def save_run(store: Path, keystore: Path, steps=STEPS, **trust) -> None:
    with cv.CheckpointManager(
        store, run_id="r", keystore=keystore, segment_size=SEGMENT, **trust
    ) as mgr:
        for step in steps:
            mgr.save(step, tensors(step))


def generations(store: Path) -> list[Path]:
    return sorted(p for p in store.iterdir() if p.name.startswith("step-"))


def data_files(store: Path) -> dict[str, tuple[int, int, str]]:
    """Every data file: inode, mtime and BLAKE3 of its bytes."""
    found = {}
    for generation in generations(store):
        for path in sorted(generation.iterdir()):
            if path.name not in (MANIFEST_NAME, SIGNATURE_NAME):
                info = path.stat()
                key = f"{generation.name}/{path.name}"
                found[key] = (info.st_ino, info.st_mtime_ns, blake3(path.read_bytes()).hexdigest())
    return found


def kek_ids(store: Path) -> set[str]:
    return {
        json.loads((g / MANIFEST_NAME).read_bytes())["encryption"]["kek_id"]
        for g in generations(store)
    }


def assert_every_generation_restores(store: Path, keystore: Path, **trust) -> None:
    # Each step is restored on purpose (allow_rollback_to) against a scratch ledger of
    # its own: with trusted keys an older step is a rollback, and this only checks
    # that every generation still reads; the run's own floor stays as it was.
    for step in STEPS:
        with (
            tempfile.TemporaryDirectory() as scratch,
            cv.CheckpointManager(
                store, run_id="r", keystore=keystore, ledger=Path(scratch) / "l", **trust
            ) as mgr,
        ):
            state = {"w": torch.zeros(64, 33), "b": torch.zeros(step * 10)}
            info = mgr.restore(state, allow_rollback_to=step)
            assert info is not None and info.step == step and not info.skipped
            for name, tensor in tensors(step).items():
                assert torch.equal(state[name], tensor), (step, name)


def audit_entries(state_dir: Path, event: str) -> list[dict]:
    lines = (state_dir / "audit.jsonl").read_text().splitlines()
    return [entry for entry in map(json.loads, lines) if entry["event"] == event]


@pytest.fixture
def keystore(tmp_path: Path) -> Path:
    return tmp_path / "keys"


@pytest.fixture
def signer(tmp_path: Path) -> tuple[Path, Path]:
    private, public = tmp_path / "signing.pem", tmp_path / "signing.pub"
    generate_keypair(private, public)
    return private, public


def test_rotation_rewraps_every_generation_without_touching_data(
    store, keystore, isolated_state_dir
):
    save_run(store, keystore)
    (old_kek,) = kek_ids(store)
    old_manifest = json.loads((generations(store)[0] / MANIFEST_NAME).read_bytes())
    before = data_files(store)

    report = rotate_run_key(store, "r", keystore)

    assert report.finished and not report.resumed
    assert report.counts()[ROTATED] == 3 and report.destroyed_kek_ids == [old_kek]
    assert kek_ids(store) == {report.new_kek_id} != {old_kek}
    assert data_files(store) == before  # same inodes, mtimes and bytes
    # Only the key wrapping changed in the manifest.
    new_manifest = json.loads((generations(store)[0] / MANIFEST_NAME).read_bytes())
    for document in (old_manifest, new_manifest):
        document.pop("manifest_blake3")
        section = document.pop("encryption")
        assert set(section) == {
            "cipher",
            "kek_id",
            "segment_size",
            "files",
            "wrapped_mac_key",
            "manifest_mac",
        }
    assert new_manifest == old_manifest
    # The old KEK is gone: no retired key file is left, and nothing opens with it.
    assert sorted(p.suffix for p in keystore.iterdir()) == [".kek"]
    with pytest.raises(KeyUnavailableError):
        LocalKeyStore(keystore).unwrap("r", old_kek, b"\0" * 60, b"context")
    assert_every_generation_restores(store, keystore)
    assert run_cli("verify", str(store), "--all").returncode == 0
    (entry,) = audit_entries(isolated_state_dir, "key_rotated")
    assert entry["run_id"] == "r" and entry["finished"] is True
    assert (entry["rotated"], entry["already_rotated"], entry["failed"]) == (3, 0, 0)
    assert entry["new_kek_id"] == report.new_kek_id and entry["destroyed_kek_ids"] == [old_kek]

    # A second rotation gives yet another key; saving goes on under the newest.
    second = rotate_run_key(store, "r", keystore)
    assert second.finished and second.new_kek_id not in (old_kek, report.new_kek_id)
    assert data_files(store) == before
    save_run(store, keystore, steps=(4,))
    assert kek_ids(store) == {second.new_kek_id}


def test_an_interrupted_rotation_resumes_and_finishes(store, keystore):
    save_run(store, keystore)
    before = data_files(store)
    (old_kek,) = kek_ids(store)

    first = rotate_run_key(store, "r", keystore, stop_after=1)
    assert not first.finished and first.destroyed_kek_ids == []
    assert (first.count(ROTATED), first.count(NOT_REACHED)) == (1, 2)
    assert kek_ids(store) == {old_kek, first.new_kek_id}
    assert (keystore / next(keystore.glob("*.kek")).with_suffix(".retired").name).exists()
    # Meanwhile every generation restores: the retired key still unwraps.
    assert_every_generation_restores(store, keystore)
    # New saves wrap under the new key already.
    save_run(store, keystore, steps=(4,))

    second = rotate_run_key(store, "r", keystore)
    assert second.resumed and second.finished
    assert second.new_kek_id == first.new_kek_id and second.destroyed_kek_ids == [old_kek]
    assert (second.count(ROTATED), second.count(ALREADY_ROTATED)) == (2, 2)
    assert kek_ids(store) == {second.new_kek_id}
    assert {k: v for k, v in data_files(store).items() if k in before} == before
    assert not list(keystore.glob("*.retired"))
    assert_every_generation_restores(store, keystore)


def test_signed_run_without_signing_key_is_refused_before_anything_changes(store, keystore, signer):
    private, public = signer
    save_run(store, keystore, signing_key=private, trusted_keys=[public])
    manifests = {g: (g / MANIFEST_NAME).read_bytes() for g in generations(store)}
    key_files = {p.name: p.read_bytes() for p in keystore.iterdir()}

    with pytest.raises(UsageError, match=r"signed.*--signing-key"):
        rotate_run_key(store, "r", keystore)
    result = run_cli(
        "keys", "rotate", "--keystore", str(keystore), "--run", "r", "--store", str(store)
    )
    assert result.returncode == 2 and "--signing-key" in result.stderr

    assert {g: (g / MANIFEST_NAME).read_bytes() for g in generations(store)} == manifests
    assert {p.name: p.read_bytes() for p in keystore.iterdir()} == key_files


def test_signed_run_is_re_signed_and_verifies(store, keystore, signer, tmp_path):
    private, public = signer
    save_run(store, keystore, signing_key=private, trusted_keys=[public])
    signatures = {g.name: (g / SIGNATURE_NAME).read_bytes() for g in generations(store)}
    before = data_files(store)

    result = run_cli(
        "keys", "rotate", "--keystore", str(keystore), "--run", "r", "--store", str(store),
        "--signing-key", str(private), "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["finished"] and report["counts"]["rotated"] == 3

    assert data_files(store) == before
    for generation in generations(store):  # new bytes, new signature
        assert (generation / SIGNATURE_NAME).read_bytes() != signatures[generation.name]
    verified = run_cli("verify", str(store), "--all", "--trusted-key", str(public), "--json")
    assert verified.returncode == 0, verified.stdout
    assert_every_generation_restores(store, keystore, trusted_keys=[public])

    # A generation signed by a key that is neither the signing key nor trusted is not
    # re-signed (that would launder it); --trusted-key accepts the earlier signer.
    other_private, other_public = tmp_path / "other.pem", tmp_path / "other.pub"
    generate_keypair(other_private, other_public)
    save_run(store, keystore, steps=(4,), signing_key=other_private)
    refused = rotate_run_key(store, "r", keystore, signing_key=private)
    assert not refused.finished and refused.count(FAILED) == 1
    (failure,) = [g for g in refused.generations if g.outcome == FAILED]
    assert failure.step == 4 and "trusted-key" in failure.detail
    done = rotate_run_key(store, "r", keystore, signing_key=private, trusted_keys=[other_public])
    assert done.finished and done.resumed and done.count(ROTATED) == 1
    assert run_cli("verify", str(store), "--all", "--trusted-key", str(public)).returncode == 0


def test_a_generation_that_fails_verification_keeps_the_old_key(store, keystore):
    save_run(store, keystore)
    victim = generations(store)[1]
    data = next(p for p in victim.iterdir() if p.name.endswith(".enc"))
    data.chmod(0o644)
    with open(data, "r+b") as handle:
        handle.seek(100)
        handle.write(b"\xff")
    report = rotate_run_key(store, "r", keystore)
    assert not report.finished and report.count(FAILED) == 1 and report.count(ROTATED) == 2
    (failure,) = [g for g in report.generations if g.outcome == FAILED]
    assert "digest-mismatch" in failure.detail
    assert list(keystore.glob("*.retired"))  # the run stays readable with the old key
    # Abandoning it is an explicit choice: the retired key is destroyed anyway.
    done = rotate_run_key(store, "r", keystore, abandon_unverified=True)
    assert done.finished and done.count(FAILED) == 1 and not list(keystore.glob("*.retired"))


def _edited(manifest: bytes, how: str) -> bytes:
    """``manifest`` as someone who can write the store might leave it: it no longer
    parses, names another run or key, claims to be plaintext, or claims the new key."""
    if how == "truncated":
        return manifest[:-5]
    doc = json.loads(manifest)
    doc.pop("manifest_blake3")
    if how == "other-run":
        doc["run_id"] = "other"
    elif how == "plaintext":
        doc["encryption"] = None
    else:  # the key id it names: unknown, or (how == "new-key") the rotation's new one
        doc["encryption"]["kek_id"] = how
    doc["manifest_blake3"] = blake3(dumps_canonical(doc)).hexdigest()
    return dumps_canonical(doc)


@pytest.mark.parametrize("how", ["truncated", "other-run", "plaintext", "unknown-key", "new-key"])
def test_an_edited_manifest_keeps_the_old_key_so_putting_it_back_loses_nothing(
    store, keystore, how
):
    """Red-team finding A08: rotation decided from the unverified manifest, so a genuine
    generation whose manifest someone edited for a while (another run id, broken bytes,
    another key id) was skipped, the retired KEK destroyed, and once the original
    manifest was put back the generation could never be read again. Whatever rotation
    cannot confirm now fails and keeps the retired KEK."""
    save_run(store, keystore)
    victim = generations(store)[1] / MANIFEST_NAME
    original = victim.read_bytes()
    victim.chmod(0o644)
    if how == "new-key":
        # Claim the key this rotation will make: the id is only known once it began.
        begun = rotate_run_key(store, "r", keystore, stop_after=0)
        victim.write_bytes(_edited(original, begun.new_kek_id))
    else:
        victim.write_bytes(_edited(original, how))
    report = rotate_run_key(store, "r", keystore)
    assert not report.finished and report.count(FAILED) == 1 and report.count(ROTATED) == 2
    (failure,) = [g for g in report.generations if g.outcome == FAILED]
    assert (failure.step == 2 and "--abandon-unverified" in failure.detail) or how == "new-key"
    assert list(keystore.glob("*.retired"))  # the run's old key is still there
    victim.write_bytes(original)  # the damage undone: nothing was lost
    done = rotate_run_key(store, "r", keystore)
    assert done.finished and done.count(ROTATED) == 1 and done.count(ALREADY_ROTATED) == 2
    assert_every_generation_restores(store, keystore)


def test_replicas_are_rotated_together_and_stay_identical(store, keystore, tmp_path):
    save_run(store, keystore)
    replica = tmp_path / "replica"
    shutil.copytree(store, replica)
    report = rotate_run_key([store, replica], "r", keystore)
    assert report.finished and report.count(ROTATED) == 6
    for original, copy in zip(generations(store), generations(replica), strict=True):
        assert (original / MANIFEST_NAME).read_bytes() == (copy / MANIFEST_NAME).read_bytes()
    assert_every_generation_restores(replica, keystore)


def test_rotation_waits_for_no_trainer(store, keystore):
    save_run(store, keystore)
    with cv.CheckpointManager(store, run_id="r", keystore=keystore) as trainer:
        trainer.save(4, tensors(4))  # a trainer that saved holds the store's writer lock
        with pytest.raises(StoreLockedError, match="rotation"):
            rotate_run_key(store, "r", keystore)
    assert not list(keystore.glob("*.retired"))  # refused before the key store changed


def test_rotation_killed_between_signature_and_manifest_resumes(store, keystore, signer):
    """A real crash in the one window that leaves a generation unreadable: the new
    signature is in place, the manifest is still the old one."""
    private, public = signer
    save_run(store, keystore, signing_key=private, trusted_keys=[public])
    before = data_files(store)
    script = textwrap.dedent(
        f"""
        import os
        from ckptvault.ops.rotation.rotate import rotate_run_key

        real_rename, renamed = os.rename, []

        def rename(source, target, **kwargs):
            if target == "manifest.json" and len(renamed) == 1:
                os._exit(9)  # the second generation: its new signature is already in place
            real_rename(source, target, **kwargs)
            if target == "manifest.json":
                renamed.append(source)

        os.rename = rename
        rotate_run_key({str(store)!r}, "r", {str(keystore)!r}, signing_key={str(private)!r})
        """
    )
    crashed = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        env=os.environ.copy(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert crashed.returncode == 9, crashed.stderr
    verified = json.loads(
        run_cli("verify", str(store), "--all", "--trusted-key", str(public), "--json").stdout
    )
    failing = [g for g in verified if not g["ok"]]
    assert len(failing) == 1 and "signature-invalid" in json.dumps(failing)

    report = rotate_run_key(store, "r", keystore, signing_key=private)
    assert report.resumed and report.finished, report.to_json()
    assert (report.count(ROTATED), report.count(ALREADY_ROTATED)) == (2, 1)
    assert data_files(store) == before
    assert run_cli("verify", str(store), "--all", "--trusted-key", str(public)).returncode == 0
    assert_every_generation_restores(store, keystore, trusted_keys=[public])


def test_an_unverifiable_signature_is_never_re_signed(store, keystore, signer):
    """Without the journal's record, a bogus signature beside a manifest under the
    retired key is what a planted generation looks like: rotation refuses it."""
    private, _public = signer
    save_run(store, keystore, signing_key=private)
    started = rotate_run_key(store, "r", keystore, signing_key=private, stop_after=0)
    assert not started.finished
    victim = generations(store)[0]
    # Made with the signing key itself, over other bytes: well formed, right key id.
    forged = sign(load_private_key(private), b"some other manifest", MANIFEST_DOMAIN)
    (victim / SIGNATURE_NAME).chmod(0o644)
    (victim / SIGNATURE_NAME).write_bytes(forged)
    report = rotate_run_key(store, "r", keystore, signing_key=private)
    assert not report.finished and report.count(FAILED) == 1
    assert "signature" in next(g.detail for g in report.generations if g.outcome == FAILED)
    assert (victim / SIGNATURE_NAME).read_bytes() == forged  # left exactly as it was


def test_destroying_a_run_mid_rotation_destroys_the_retired_key_too(keystore):
    keys = LocalKeyStore(keystore)
    old_kek, wrapped = keys.wrap("r", b"k" * 32, b"ctx")
    rotation = keys.begin_rotation("r")
    assert rotation.retired_kek_ids == (old_kek,) and not rotation.resumed
    assert keys.begin_rotation("r") == type(rotation)("r", rotation.new_kek_id, (old_kek,), True)
    assert keys.unwrap("r", old_kek, wrapped, b"ctx") == b"k" * 32  # retired: still unwraps
    new_kek, rewrapped = keys.rewrap("r", old_kek, wrapped, b"ctx")
    assert new_kek == rotation.new_kek_id
    keys.destroy("r")
    assert sorted(p.suffix for p in keystore.iterdir()) == [".tombstone"]
    for kek, blob in ((old_kek, wrapped), (new_kek, rewrapped)):
        with pytest.raises(KeyDestroyedError):
            keys.unwrap("r", kek, blob, b"ctx")
    with pytest.raises(KeyDestroyedError):
        keys.begin_rotation("r")
