"""The restore checks: every rule fires with its own reason, and restore skips the
generation and tries the next (the seed's six cases and more)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from blake3 import blake3

import ckptvault as cv
from ckptvault.errors import NoValidCheckpoint, RollbackError, UsageError
from ckptvault.format.canonical import dumps_canonical
from ckptvault.trust.digests import derived_file_digest
from ckptvault.trust.signing import MANIFEST_DOMAIN, generate_keypair, load_private_key, sign
from support.common import (
    assert_same_tensors,
    make_training_state,
    model_snapshot,
    only_tensor_file,
    train_steps,
    writable,
)
from support.forging import read_logical, write_logical


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    paths = {}
    for name in ("trainer", "stranger"):
        generate_keypair(tmp_path / f"{name}.pem", tmp_path / f"{name}.pub")
        paths[name] = tmp_path / f"{name}.pem"
        paths[f"{name}_pub"] = tmp_path / f"{name}.pub"
    return paths


def manager(store: Path, keys: dict[str, Path], tmp_path: Path, run_id: str = "run42", **extra):
    options = {
        "run_id": run_id,
        "signing_key": keys["trainer"],
        "trusted_keys": [keys["trainer_pub"]],
        "ledger": tmp_path / "ledger.sqlite3",
    }
    options.update(extra)
    return cv.CheckpointManager(store, **options)


@pytest.fixture
def signed(store: Path, keys, tmp_path: Path):
    """Steps 1000 and 2000 of run42, signed; returns their paths and weights."""
    state = make_training_state()
    weights, paths = {}, {}
    with manager(store, keys, tmp_path) as mgr:
        for step in (1000, 2000):
            train_steps(state, 2)
            weights[step] = model_snapshot(state["model"])
            paths[step] = Path(mgr.save(step, state).result().path)
    return paths, weights


def restore(store, keys, tmp_path, **kwargs):
    fresh = make_training_state(seed=7)
    with manager(store, keys, tmp_path) as mgr:
        info = mgr.restore(fresh, **kwargs)
    return info, fresh


def reason_codes(info) -> list[str]:
    return [s.reason.split(":")[0] for s in info.skipped]


def resign(path: Path, keys, key: str = "trainer") -> None:
    """Re-sign an edited manifest (an attacker holding that key)."""
    signature = sign(
        load_private_key(keys[key]), (path / "manifest.json").read_bytes(), MANIFEST_DOMAIN
    )
    writable(path / "manifest.sig").write_bytes(signature)


def rewrite_manifest(path: Path, change) -> None:
    """Edit ``manifest.json`` as stored (format 3: the root; its indexes stay) and
    refresh its self-digest. Names that no index could cover (unsafe ones) can only
    be planted this way; edits of chunk digests or metadata go through
    :func:`forging.read_logical` and :func:`forging.write_logical`."""
    document = json.loads((path / "manifest.json").read_bytes())
    document.pop("manifest_blake3")
    change(document)
    document["manifest_blake3"] = blake3(dumps_canonical(document)).hexdigest()
    writable(path / "manifest.json").write_bytes(dumps_canonical(document))


# -- the seed's six cases -------------------------------------------------------------


def test_clean_restore_reports_the_signer(store, keys, tmp_path, signed):
    _, weights = signed
    info, fresh = restore(store, keys, tmp_path)
    assert info.step == 2000 and info.skipped == [] and info.signer.startswith("ed25519:")
    assert_same_tensors(model_snapshot(fresh["model"]), weights[2000])


def test_one_shard_edited(store, keys, tmp_path, signed):
    paths, weights = signed
    shard = only_tensor_file(paths[2000])
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0x80
    writable(shard).write_bytes(bytes(data))
    info, fresh = restore(store, keys, tmp_path)
    assert info.step == 1000 and reason_codes(info) == ["digest-mismatch"]
    assert_same_tensors(model_snapshot(fresh["model"]), weights[1000])


def test_pickle_file_added(store, keys, tmp_path, signed):
    paths, _ = signed
    (paths[2000] / "optimizer.pt").write_bytes(b"\x80\x04\x95 a pickle")
    info, _ = restore(store, keys, tmp_path)
    assert info.step == 1000 and reason_codes(info) == ["pickle-file"]
    assert "optimizer.pt" in info.skipped[0].reason


@pytest.mark.parametrize("name", ["model.pth", "state.pkl", "x.pickle", "weights.bin"])
def test_every_pickle_extension_is_refused(store, keys, tmp_path, signed, name):
    paths, _ = signed
    (paths[2000] / name).write_bytes(b"")
    info, _ = restore(store, keys, tmp_path)
    assert reason_codes(info) == ["pickle-file"]


def test_older_checkpoint_offered_is_a_rollback(store, keys, tmp_path, signed):
    paths, _ = signed
    assert restore(store, keys, tmp_path)[0].step == 2000  # the floor is now 2000
    shutil.rmtree(paths[2000])  # only the older, validly signed generation is offered
    fresh = make_training_state(seed=5)
    before = model_snapshot(fresh["model"])
    with manager(store, keys, tmp_path) as mgr, pytest.raises(RollbackError) as raised:
        mgr.restore(fresh)
    assert isinstance(raised.value, NoValidCheckpoint)
    # The vanished step 2000 is reported too: the ledger saw it published.
    assert [(step, reason.split(":")[0]) for _, step, reason in raised.value.rejected] == [
        (2000, "generation-missing"),
        (1000, "rollback"),
    ]
    assert "below the restore floor 2000" in str(raised.value)
    assert_same_tensors(model_snapshot(fresh["model"]), before)


def test_step_number_edited_breaks_the_signature(store, keys, tmp_path, signed):
    paths, _ = signed
    old = paths[1000]
    rewrite_manifest(old, lambda m: m.update(step=3000))
    old.rename(store / old.name.replace("step-000000001000", "step-000000003000"))
    info, _ = restore(store, keys, tmp_path)
    assert info.step == 2000 and reason_codes(info) == ["signature-invalid"]


def test_checkpoint_from_another_run(store, keys, tmp_path, signed):
    _, weights = signed
    other = make_training_state(seed=3)
    with manager(store, keys, tmp_path, run_id="run17") as mgr:
        mgr.save(3000, other)  # same trusted key, other run
    info, fresh = restore(store, keys, tmp_path)
    assert info.step == 2000 and reason_codes(info) == ["run-mismatch"]
    assert_same_tensors(model_snapshot(fresh["model"]), weights[2000])


# -- more rules --------------------------------------------------------------------


def test_deleted_shard(store, keys, tmp_path, signed):
    paths, _ = signed
    only_tensor_file(paths[2000]).unlink()
    info, _ = restore(store, keys, tmp_path)
    assert reason_codes(info) == ["file-missing"]


def test_symlinked_shard_with_identical_bytes(store, keys, tmp_path, signed):
    paths, _ = signed
    shard = only_tensor_file(paths[2000])
    copy = tmp_path / "outside.safetensors"
    shutil.copyfile(shard, copy)
    shard.unlink()
    os.symlink(copy, shard)
    info, _ = restore(store, keys, tmp_path)
    assert reason_codes(info) == ["unsafe-entry"] and "symlink" in info.skipped[0].reason


def test_hard_linked_shard(store, keys, tmp_path, signed):
    paths, _ = signed
    os.link(only_tensor_file(paths[2000]), tmp_path / "second-name")
    info, _ = restore(store, keys, tmp_path)
    assert reason_codes(info) == ["unsafe-entry"] and "hard-linked" in info.skipped[0].reason


def test_special_file_and_subdirectory(store, keys, tmp_path, signed):
    paths, _ = signed
    os.mkfifo(paths[2000] / "pipe")
    (paths[1000] / "subdir").mkdir()
    with manager(store, keys, tmp_path) as mgr, pytest.raises(NoValidCheckpoint) as raised:
        mgr.restore(make_training_state())
    assert all(reason.startswith("unsafe-entry") for _, _, reason in raised.value.rejected)


def test_symlinked_generation_directory(store, keys, tmp_path, signed):
    paths, _ = signed
    moved = tmp_path / "elsewhere"
    paths[2000].rename(moved)
    os.symlink(moved, paths[2000])
    info, _ = restore(store, keys, tmp_path)
    assert reason_codes(info) == ["unsafe-entry"] and "not a directory" in info.skipped[0].reason


def test_traversal_name_in_the_manifest(store, keys, tmp_path, signed):
    paths, _ = signed

    def traverse(manifest):
        name = next(iter(manifest["files"]))
        manifest["files"]["../../evil.safetensors"] = manifest["files"].pop(name)

    rewrite_manifest(paths[2000], traverse)
    resign(paths[2000], keys)  # even a validly signed manifest may not point outside
    info, _ = restore(store, keys, tmp_path)
    assert reason_codes(info) == ["unsafe-path"]


@pytest.mark.parametrize("name", ["/etc/passwd", ".hidden", "a/b.safetensors"])
def test_absolute_hidden_and_nested_names_are_unsafe(store, keys, tmp_path, signed, name):
    paths, _ = signed
    rewrite_manifest(
        paths[2000], lambda m: m["files"].update({name: m["files"][next(iter(m["files"]))]})
    )
    resign(paths[2000], keys)
    info, _ = restore(store, keys, tmp_path)
    assert reason_codes(info) == ["unsafe-path"]


def test_missing_signature(store, keys, tmp_path, signed):
    paths, _ = signed
    (paths[2000] / "manifest.sig").unlink()
    info, _ = restore(store, keys, tmp_path)
    assert reason_codes(info) == ["signature-missing"]


def test_signature_by_an_untrusted_key(store, keys, tmp_path, signed):
    paths, _ = signed
    resign(paths[2000], keys, key="stranger")
    info, _ = restore(store, keys, tmp_path)
    assert reason_codes(info) == ["signature-untrusted"]


def test_unsigned_store_is_refused_when_keys_are_required(store, keys, tmp_path):
    with cv.CheckpointManager(store, run_id="run42") as mgr:
        mgr.save(1, make_training_state())
    with (
        manager(store, keys, tmp_path) as mgr,
        pytest.raises(NoValidCheckpoint, match="signature-missing"),
    ):
        mgr.restore(make_training_state())


def test_a_file_not_in_our_formats(store, tmp_path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        path = Path(mgr.save(1, make_training_state()).result().path)
    # Format 3: a listed file is a rank's (r<rank>-...), its chunk digests in that
    # rank's index and its derived digest in the root; all of it recomputed.
    name, chunks = "r00000-notes.txt", [blake3(b"hello").hexdigest()]
    (path / name).write_bytes(b"hello")
    document = read_logical(path)
    document["files"][name] = {
        "size": 5,
        "blake3": derived_file_digest(5, chunks),
        "chunks": chunks,
    }
    write_logical(path, document)
    with (
        cv.CheckpointManager(store, run_id="r") as mgr,
        pytest.raises(NoValidCheckpoint, match="unknown-format"),
    ):
        mgr.restore(make_training_state())


def test_garbage_tensor_file_is_not_our_format(store, tmp_path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        path = Path(mgr.save(1, make_training_state()).result().path)
    shard = only_tensor_file(path)
    size = shard.stat().st_size
    writable(shard).write_bytes(b"\xff" * size)  # same size, not a tensor file
    with (
        cv.CheckpointManager(store, run_id="r") as mgr,
        pytest.raises(NoValidCheckpoint, match="tensor-file-invalid"),
    ):
        mgr.restore(make_training_state())


def test_cli_verify_with_trusted_key(store, keys, tmp_path, signed):
    from support.common import run_cli

    paths, _ = signed
    assert (
        run_cli("verify", str(store), "--all", "--trusted-key", str(keys["trainer_pub"])).returncode
        == 0
    )
    result = run_cli(
        "verify", str(store), "--all", "--json", "--trusted-key", str(keys["stranger_pub"])
    )
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert {r["problems"][0]["code"] for r in report} == {"signature-untrusted"}
    (paths[1000] / "manifest.sig").unlink()
    result = run_cli(
        "verify", str(store), "--step", "1000", "--json", "--trusted-key", str(keys["trainer_pub"])
    )
    assert json.loads(result.stdout)[0]["problems"][0]["code"] == "signature-missing"


def test_ledger_and_keystore_must_live_outside_the_store(store, keys, tmp_path):
    with pytest.raises(UsageError, match="ledger"):
        cv.CheckpointManager(store, run_id="r", ledger=store / "ledger.sqlite3")
    with pytest.raises(UsageError, match="key store"):
        cv.CheckpointManager(store, run_id="r", keystore=store / "keys")


def test_signature_verified_before_the_manifest_is_parsed(store, keys, tmp_path, signed):
    paths, _ = signed
    manifest = paths[2000] / "manifest.json"
    writable(manifest).write_bytes(b"{ not json at all")
    info, _ = restore(store, keys, tmp_path)
    # Not "manifest-invalid": the signature check ran first and refused the bytes.
    assert reason_codes(info) == ["signature-invalid"]


def test_keys_generate_cli(tmp_path):
    from support.common import run_cli

    private, public = tmp_path / "k" / "trainer.pem", tmp_path / "k" / "trainer.pub"
    result = run_cli("keys", "generate", "--private", str(private), "--public", str(public))
    assert result.returncode == 0 and "ed25519:" in result.stdout
    assert private.stat().st_mode & 0o777 == 0o600
    assert b"PUBLIC KEY" in public.read_bytes() and b"PRIVATE KEY" in private.read_bytes()
    again = run_cli("keys", "generate", "--private", str(private), "--public", str(public))
    assert again.returncode == 2 and "refusing to overwrite" in again.stderr


def test_a_single_trusted_key_may_be_given_alone(store, keys, tmp_path, signed):
    with cv.CheckpointManager(
        store, run_id="run42", trusted_keys=keys["trainer_pub"], ledger=tmp_path / "ledger.sqlite3"
    ) as mgr:
        assert mgr.restore(make_training_state()).step == 2000
