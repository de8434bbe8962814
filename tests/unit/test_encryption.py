"""Per-run envelope encryption: round trip, tamper detection on ciphertext, key
binding, crypto-erase."""

from __future__ import annotations

import base64
import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from blake3 import blake3

import ckptvault as cv
from ckptvault.errors import KeyDestroyedError, NoValidCheckpoint
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.container import SEGMENT_OVERHEAD
from ckptvault.format.layout import generation_dirname
from ckptvault.format.manifest import authenticated_bytes, stored_authenticated_bytes
from ckptvault.saving.generation_writer import GenerationWriter
from ckptvault.trust.digests import derived_file_digest
from ckptvault.trust.envelope import manifest_key_binding
from ckptvault.trust.keystore import LocalKeyStore
from ckptvault.trust.manifest_auth import manifest_mac
from support.common import (
    assert_same_tensors,
    make_training_state,
    model_snapshot,
    run_cli,
    train_steps,
    writable,
)
from support.forging import read_logical, write_logical

SEGMENT = 4096  # small segments so that tensors span many of them


@pytest.fixture
def keystore(tmp_path: Path) -> Path:
    return tmp_path / "keys"


def encrypted_manager(store: Path, keystore: Path, run_id: str = "r", **kwargs):
    return cv.CheckpointManager(
        store, run_id=run_id, keystore=keystore, segment_size=SEGMENT, **kwargs
    )


@pytest.fixture
def encrypted(store: Path, keystore: Path):
    state = make_training_state(width=64)
    weights, paths = {}, {}
    with encrypted_manager(store, keystore) as mgr:
        for step in (1, 2):
            train_steps(state, 1)
            weights[step] = model_snapshot(state["model"])
            paths[step] = Path(mgr.save(step, state).result().path)
    return paths, weights


def enc_file(path: Path) -> Path:
    files = sorted(path.glob("*.safetensors.enc"))
    assert len(files) == 1
    return files[0]


def refresh_digests(path: Path) -> None:
    """Rewrite the manifest's digests to match the files (an attacker without the key
    who can write the store but has no signing key): chunk digests (in the indexes,
    format 3), derived whole-file digests and sizes (in the root), index digests."""
    document = read_logical(path)
    chunk = document["chunk_size"]
    for name, record in document["files"].items():
        data = (path / name).read_bytes()
        record["size"] = len(data)
        record["chunks"] = [
            blake3(data[i : i + chunk]).hexdigest() for i in range(0, len(data), chunk)
        ]
        record["blake3"] = derived_file_digest(len(data), record["chunks"])
    write_logical(path, document)


def reseal(path: Path, document: dict) -> None:
    """Write the logical ``document`` (:func:`forging.read_logical`) as the
    generation's manifest (root and indexes) with every digest and the self-digest
    correct, as anyone who can write the store can."""
    write_logical(path, document)


def remac(path: Path, keystore: Path) -> None:
    """Recompute the manifest's MAC with the run's key, as only the KEK holder can.
    Lets a test reach the checks behind the MAC (AES-GCM segments, key bindings).
    The MAC covers the root (format 3: which covers the indexes by digest)."""
    document = json.loads((path / "manifest.json").read_bytes())
    section = document["encryption"]
    mac_key = LocalKeyStore(keystore).unwrap(
        document["run_id"],
        section["kek_id"],
        base64.b64decode(section["wrapped_mac_key"]),
        manifest_key_binding(document["run_id"], document["generation_id"]),
    )
    section["manifest_mac"] = manifest_mac(mac_key, authenticated_bytes(document))
    document.pop("manifest_blake3")
    document["manifest_blake3"] = blake3(dumps_canonical(document)).hexdigest()
    writable(path / "manifest.json").write_bytes(dumps_canonical(document))


def restore_codes(store, keystore, run_id: str = "r") -> list[str]:
    with encrypted_manager(store, keystore, run_id=run_id) as mgr:
        try:
            info = mgr.restore(make_training_state(width=64, seed=9))
        except NoValidCheckpoint as exc:
            return [reason.split(":")[0] for _, _, reason in exc.rejected]
    return [s.reason.split(":")[0] for s in info.skipped]


def test_roundtrip_and_what_is_stored(store, keystore, encrypted):
    paths, weights = encrypted
    fresh = make_training_state(width=64, seed=9)
    with encrypted_manager(store, keystore) as mgr:
        info = mgr.restore(fresh)
    assert info.step == 2
    assert_same_tensors(model_snapshot(fresh["model"]), weights[2])
    manifest = json.loads((paths[2] / "manifest.json").read_bytes())
    section = manifest["encryption"]
    assert section["cipher"] == "AES-256-GCM" and section["segment_size"] == SEGMENT
    state_file = "r00000-state.json.enc"
    assert set(section["files"]) == set(manifest["files"]) == {enc_file(paths[2]).name, state_file}
    # The non-tensor state (counters, loss history, RNG states) is not in clear either:
    # the manifest only points at the encrypted state file.
    assert manifest["state"] == {"$encrypted_file": state_file}
    for leaked in (b"tokens_seen", b"history", b"bit_generator", b"PCG64"):
        assert leaked not in (paths[2] / "manifest.json").read_bytes()
        assert leaked not in (paths[2] / state_file).read_bytes()
    # No plaintext key anywhere: not the KEK, and the wrapped key is not a bare key.
    kek_file = next(keystore.glob("*.kek"))
    kek = json.loads(kek_file.read_text())
    assert kek["key"] not in (paths[2] / "manifest.json").read_text()
    assert section["kek_id"] == kek["kek_id"]
    wrapped = base64.b64decode(section["files"][enc_file(paths[2]).name]["wrapped_key"])
    assert len(wrapped) == 12 + 32 + 16
    assert oct(kek_file.stat().st_mode & 0o777) == "0o600"
    # The tensor bytes do not appear in the stored file.
    stored = enc_file(paths[2]).read_bytes()
    weight = weights[2]["fc1.weight"].numpy().tobytes()
    assert weight[:64] not in stored


def test_anyone_can_verify_integrity_without_the_key(store, encrypted):
    result = run_cli("verify", str(store), "--all", "--json")
    assert result.returncode == 0
    reports = json.loads(result.stdout)
    assert all(r["encrypted"] and r["ok"] for r in reports)
    # ...but not the manifest's MAC, which takes the run's key: a note, not a failure.
    assert all(len(r["notes"]) == 1 and "MAC" in r["notes"][0] for r in reports)
    text = run_cli("verify", str(store))
    assert text.returncode == 0 and "note:" in text.stdout and "MAC" in text.stdout


def test_restore_without_the_key_store_is_refused(store, encrypted):
    with (
        cv.CheckpointManager(store, run_id="r") as mgr,
        pytest.raises(NoValidCheckpoint, match="key-unavailable"),
    ):
        mgr.restore(make_training_state(width=64))


def _segments(path: Path) -> tuple[int, int]:
    """(offset of segment 0, record size of a full segment)."""
    data = path.read_bytes()
    (header_len,) = struct.unpack("<I", data[8:12])
    return 12 + header_len, SEGMENT + SEGMENT_OVERHEAD


@pytest.mark.parametrize("where", ["first", "middle", "tag", "nonce", "last"])
def test_any_flipped_ciphertext_byte_is_detected(store, keystore, encrypted, where):
    paths, _ = encrypted
    file = enc_file(paths[2])
    start, record = _segments(file)
    data = bytearray(file.read_bytes())
    offset = {
        "first": start + 12,
        "middle": start + 3 * record + 100,
        "tag": start + 2 * record - 1,
        "nonce": start + record + 2,
        "last": len(data) - 1,
    }[where]
    data[offset] ^= 0x04
    writable(file).write_bytes(bytes(data))
    assert restore_codes(store, keystore) == ["digest-mismatch"]  # the manifest digest catches it
    refresh_digests(paths[2])  # an attacker also rewrites the digests...
    assert restore_codes(store, keystore) == ["manifest-unauthenticated"]  # ...the MAC catches it
    remac(paths[2], keystore)  # and were the MAC forged too (it takes the run's key)...
    assert restore_codes(store, keystore) == ["authentication-failed"]  # ...AES-GCM still would


def test_reordered_segments_are_detected(store, keystore, encrypted):
    paths, _ = encrypted
    file = enc_file(paths[2])
    start, record = _segments(file)
    data = bytearray(file.read_bytes())
    first, second = data[start : start + record], data[start + record : start + 2 * record]
    data[start : start + 2 * record] = second + first
    writable(file).write_bytes(bytes(data))
    refresh_digests(paths[2])
    assert restore_codes(store, keystore) == ["manifest-unauthenticated"]
    remac(paths[2], keystore)
    assert restore_codes(store, keystore) == ["authentication-failed"]


def test_dropped_segment_is_detected(store, keystore, encrypted):
    paths, _ = encrypted
    file = enc_file(paths[2])
    start, record = _segments(file)
    data = bytearray(file.read_bytes())
    del data[start + record : start + 2 * record]  # drop segment 2 of many
    writable(file).write_bytes(bytes(data))
    refresh_digests(paths[2])
    assert restore_codes(store, keystore) == ["tensor-file-invalid"]  # the container size says so


def test_truncated_to_fewer_segments_with_edited_header_is_detected(store, keystore, encrypted):
    paths, _ = encrypted
    file = enc_file(paths[2])
    data = file.read_bytes()
    (header_len,) = struct.unpack("<I", data[8:12])
    header = json.loads(data[12 : 12 + header_len])
    start, record = _segments(file)
    # Keep only the first 3 full segments and claim that is the whole plaintext.
    header["plaintext_size"] = 3 * SEGMENT
    body = dumps_canonical(header)
    forged = data[:8] + struct.pack("<I", len(body)) + body + data[start : start + 3 * record]
    writable(file).write_bytes(forged)
    refresh_digests(paths[2])
    # The tensors the manifest places in the file no longer fit the shortened
    # plaintext: refused from the container header, before anything is decrypted.
    assert restore_codes(store, keystore) == ["manifest-inconsistent"]


def test_container_segments_are_bound_to_position_finality_and_file():
    import io

    from ckptvault.errors import DecryptionError
    from ckptvault.format.container import build_container_header
    from ckptvault.trust.envelope import EncryptingWriter, SegmentDecryptor, binding, new_data_key

    key, plaintext = new_data_key(), bytes(range(256)) * 64  # 16 KiB = 4 segments
    context = binding("run", "gen", "file.safetensors.enc")
    sink = io.BytesIO()
    writer = EncryptingWriter(sink, key, context, SEGMENT, len(plaintext))
    writer.write(plaintext)
    writer.close()
    blob = sink.getvalue()
    start, record = len(writer.header.header_bytes), SEGMENT + SEGMENT_OVERHEAD

    def decrypt(data: bytes, ctx: bytes = context) -> bytes:
        out = bytearray()
        decryptor = SegmentDecryptor(key, ctx, "file", lambda offset, piece: out.extend(piece))
        decryptor.feed(data)
        decryptor.finish()
        return bytes(out)

    assert decrypt(blob) == plaintext
    segments = [blob[start + i * record : start + (i + 1) * record] for i in range(4)]
    # Truncation to whole segments with a matching header: segment 3 was not final.
    short_header = build_container_header(SEGMENT, 3 * SEGMENT).header_bytes
    with pytest.raises(DecryptionError):
        decrypt(short_header + b"".join(segments[:3]))
    with pytest.raises(DecryptionError):  # reordered
        decrypt(blob[:start] + segments[1] + segments[0] + segments[2] + segments[3])
    for other in (
        binding("run", "gen", "other.enc"),
        binding("run", "gen2", "file.safetensors.enc"),
        binding("run2", "gen", "file.safetensors.enc"),
    ):
        with pytest.raises(DecryptionError):  # moved to another file, generation or run
            decrypt(blob, other)


def test_truncated_file_is_detected(store, keystore, encrypted):
    paths, _ = encrypted
    file = enc_file(paths[2])
    data = file.read_bytes()
    writable(file).write_bytes(data[:-1000])
    assert restore_codes(store, keystore) == ["size-mismatch"]
    refresh_digests(paths[2])
    assert restore_codes(store, keystore) == ["tensor-file-invalid"]


def test_file_moved_between_generations_is_detected(store, keystore, encrypted):
    paths, _ = encrypted
    older, newer = enc_file(paths[1]), enc_file(paths[2])
    writable(newer).write_bytes(older.read_bytes())
    refresh_digests(paths[2])
    assert restore_codes(store, keystore) == ["manifest-unauthenticated"]
    remac(paths[2], keystore)  # behind the MAC:
    assert restore_codes(store, keystore) == ["authentication-failed"]  # other data key
    # Moving the wrapped key along does not help: it is bound to its generation.
    source = json.loads((paths[1] / "manifest.json").read_bytes())["encryption"]["files"][
        older.name
    ]

    def take_key(document):
        document["encryption"]["files"][newer.name] = source

    document = read_logical(paths[2])
    take_key(document)
    reseal(paths[2], document)
    assert restore_codes(store, keystore) == ["manifest-unauthenticated"]
    remac(paths[2], keystore)
    assert restore_codes(store, keystore) == ["key-unavailable"]


def test_generation_moved_between_runs_is_detected(tmp_path, keystore):
    """A generation copied into another run's store, relabelled, does not decrypt."""
    a, b = tmp_path / "a", tmp_path / "b"
    with encrypted_manager(a, keystore, run_id="run-a") as mgr:
        path_a = Path(mgr.save(1, make_training_state(width=64)).result().path)
    with encrypted_manager(b, keystore, run_id="run-b") as mgr:
        path_b = Path(mgr.save(1, make_training_state(width=64)).result().path)
    writable(enc_file(path_b)).write_bytes(enc_file(path_a).read_bytes())
    refresh_digests(path_b)
    assert restore_codes(b, keystore, run_id="run-b") == ["manifest-unauthenticated"]
    remac(path_b, keystore)
    assert restore_codes(b, keystore, run_id="run-b") == ["authentication-failed"]


def test_keys_destroy_erases_every_generation_and_blocks_saves(
    store, keystore, encrypted, tmp_path
):
    copy = tmp_path / "replica"
    import shutil

    shutil.copytree(store, copy)
    result = run_cli("keys", "destroy", "--keystore", str(keystore), "--run", "r")
    assert result.returncode == 2 and "--yes" in result.stderr  # refuses without confirmation
    result = run_cli("keys", "destroy", "--keystore", str(keystore), "--run", "r", "--yes")
    assert result.returncode == 0, result.stderr
    assert not list(keystore.glob("*.kek")) and list(keystore.glob("*.tombstone"))
    for where in (store, copy):
        fresh = make_training_state(width=64, seed=1)
        before = model_snapshot(fresh["model"])
        with encrypted_manager(where, keystore) as mgr:
            with pytest.raises(KeyDestroyedError, match="destroyed"):
                mgr.restore(fresh)
            with pytest.raises(KeyDestroyedError):
                mgr.save(3, fresh)
        assert_same_tensors(model_snapshot(fresh["model"]), before)
    listing = json.loads(run_cli("keys", "list", "--keystore", str(keystore), "--json").stdout)
    assert listing[0]["run_id"] == "r" and listing[0]["destroyed_at"]
    # Other runs in the same key store are unaffected.
    with encrypted_manager(tmp_path / "other", keystore, run_id="other") as mgr:
        mgr.save(1, {"x": torch.ones(3)})
        assert mgr.restore({"x": torch.zeros(3)}).step == 1


def test_key_store_interface_wraps_without_revealing_the_kek(keystore):
    store = LocalKeyStore(keystore)
    kek_id, wrapped = store.wrap("run", b"k" * 32, b"context")
    assert store.unwrap("run", kek_id, wrapped, b"context") == b"k" * 32
    from ckptvault.errors import KeyUnavailableError

    with pytest.raises(KeyUnavailableError):
        store.unwrap("run", kek_id, wrapped, b"other context")
    assert [info.run_id for info in store.list_keys()] == ["run"]


def test_destroyed_key_blocks_plaintext_generations_too(store, keystore, tmp_path):
    with cv.CheckpointManager(store, run_id="r") as mgr:  # written before encryption was on
        mgr.save(1, {"x": torch.ones(3)})
    with encrypted_manager(store, keystore) as mgr:
        mgr.save(2, {"x": torch.ones(3)})
    LocalKeyStore(keystore).destroy("r")
    with encrypted_manager(store, keystore) as mgr, pytest.raises(KeyDestroyedError):
        mgr.restore({"x": torch.zeros(3)}, step=1)


def test_a_plaintext_generation_planted_in_an_encrypted_run_is_refused(
    store, keystore, encrypted, tmp_path
):
    planted = tmp_path / "planted"
    with cv.CheckpointManager(planted, run_id="r") as mgr:  # same run id, no encryption
        path = Path(mgr.save(9, make_training_state(width=64)).result().path)
    path.rename(store / path.name)
    assert restore_codes(store, keystore) == ["not-encrypted"]


def _forge_manifest(path: Path, edit) -> None:
    """Edit a generation's (logical) manifest and refresh every digest, as a
    store-write-only attacker (no signing key, no KEK) can."""
    document = read_logical(path)
    edit(document)
    write_logical(path, document)
    refresh_digests(path)


def test_an_empty_encryption_section_does_not_let_plaintext_in(
    store, keystore, encrypted, tmp_path
):
    """Plaintext files under an encryption section that wraps no key: still refused."""
    planted = tmp_path / "planted"
    with cv.CheckpointManager(planted, run_id="r") as mgr:
        path = Path(mgr.save(9, make_training_state(width=64)).result().path)

    def claim_encryption(document: dict) -> None:
        document["encryption"] = {
            "cipher": "AES-256-GCM",
            "kek_id": "kek-0000000000000000",
            "segment_size": SEGMENT,
            "files": {},
        }

    _forge_manifest(path, claim_encryption)
    path.rename(store / path.name)
    assert restore_codes(store, keystore) == ["not-encrypted"]


def test_plaintext_state_beside_encrypted_tensors_is_refused(store, keystore, encrypted):
    """Encrypted tensor files but the state put back in clear (a planted tree)."""
    paths, _ = encrypted
    newest = paths[2]

    def state_in_clear(document: dict) -> None:
        name = document["state"]["$encrypted_file"]
        document["state"] = {"meta": {"tokens_seen": 10**9}}
        del document["files"][name]
        del document["encryption"]["files"][name]

    _forge_manifest(newest, state_in_clear)
    writable(newest / "r00000-state.json.enc").unlink()
    assert restore_codes(store, keystore) == ["not-encrypted"]


def test_key_store_with_unsafe_permissions_is_refused(store, keystore, encrypted):
    from ckptvault.errors import KeyUnavailableError

    kek = next(keystore.glob("*.kek"))
    kek.chmod(0o644)
    with encrypted_manager(store, keystore) as mgr:
        with pytest.raises(NoValidCheckpoint, match="unsafe permissions"):
            mgr.restore(make_training_state(width=64))
        with pytest.raises(KeyUnavailableError, match="unsafe permissions"):
            mgr.save(3, make_training_state(width=64))
    kek.chmod(0o600)
    keystore.chmod(0o777)
    with (
        encrypted_manager(store, keystore) as mgr,
        pytest.raises(KeyUnavailableError, match="chmod 700"),
    ):
        mgr.save(3, make_training_state(width=64))


def test_damaged_key_files_give_typed_errors(store, keystore, encrypted):
    from ckptvault.errors import KeyUnavailableError

    kek = next(keystore.glob("*.kek"))
    kek.write_text("{not json")
    with (
        encrypted_manager(store, keystore) as mgr,
        pytest.raises(KeyUnavailableError, match="malformed"),
    ):
        mgr.save(3, make_training_state(width=64))
    (keystore / "foreign.kek").write_text("[1, 2]")
    (keystore / "foreign.kek").chmod(0o600)
    assert run_cli("keys", "list", "--keystore", str(keystore)).returncode == 0


def test_concurrent_first_use_creates_one_key(tmp_path):
    import threading

    store = LocalKeyStore(tmp_path / "keys")
    ids: list[str] = []
    threads = [
        threading.Thread(target=lambda: ids.append(store.wrap("r", b"k" * 32, b"c")[0]))
        for _ in range(8)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(set(ids)) == 1 and len(list((tmp_path / "keys").glob("*.kek"))) == 1


# -- manifest authentication: an encrypted run without signatures ---------------------


def _clone_as_step(source: Path, store: Path, step: int) -> Path:
    """Copy a generation under another step (same generation id), as anyone who can
    write the store can: only ``step`` changes in the manifest, resealed."""
    document = read_logical(source)
    document["step"] = step
    target = store / generation_dirname(step, document["generation_id"])
    shutil.copytree(source, target)
    target.chmod(0o755)
    reseal(target, document)
    return target


def test_relabelled_old_generation_is_refused_and_the_floor_holds(
    store, keystore, encrypted, tmp_path
):
    """Red-team finding 6a: step 1 copied as step 10**11 would have raised the floor
    past every genuine generation."""
    paths, weights = encrypted
    ledger = tmp_path / "control" / "ledger.sqlite3"
    forged = _clone_as_step(paths[1], store, 10**11)
    fresh = make_training_state(width=64, seed=9)
    with encrypted_manager(store, keystore, ledger=ledger) as mgr:
        info = mgr.restore(fresh)
    assert info.step == 2
    assert [s.reason.split(":")[0] for s in info.skipped] == ["manifest-unauthenticated"]
    assert_same_tensors(model_snapshot(fresh["model"]), weights[2])
    shutil.rmtree(forged)  # the floor was never raised: step 2 still restores
    with encrypted_manager(store, keystore, ledger=ledger) as mgr:
        assert mgr.restore(make_training_state(width=64, seed=9)).step == 2


def _swap_weight_and_moment(document: dict) -> None:
    tensors = document["dcp"]["tensors"]
    a, b = "model/fc1.weight", "optimizer/state/fc1.weight/exp_avg"
    tensors[a]["chunks"], tensors[b]["chunks"] = tensors[b]["chunks"], tensors[a]["chunks"]


def test_swapped_chunk_records_are_refused(store, keystore, encrypted):
    """Red-team finding 6b: the model weight would have received the optimizer's
    exp_avg bytes (same shape, the decrypted headers move with the records)."""
    paths, weights = encrypted
    document = read_logical(paths[2])
    _swap_weight_and_moment(document)
    reseal(paths[2], document)
    fresh = make_training_state(width=64, seed=9)
    with encrypted_manager(store, keystore) as mgr:
        info = mgr.restore(fresh)
    assert info.step == 1
    assert [s.reason.split(":")[0] for s in info.skipped] == ["manifest-unauthenticated"]
    assert_same_tensors(model_snapshot(fresh["model"]), weights[1])
    # The MAC is what stops it: re-MACed (which takes the run's key), the swap loads.
    remac(paths[2], keystore)
    with encrypted_manager(store, keystore) as mgr:
        assert mgr.restore(fresh).step == 2
    assert not torch.equal(fresh["model"].fc1.weight.detach(), weights[2]["fc1.weight"])


@pytest.mark.parametrize(
    ("taken", "code"),
    [
        (("manifest_mac",), "manifest-unauthenticated"),
        (("wrapped_mac_key",), "key-unavailable"),
        (("wrapped_mac_key", "manifest_mac"), "key-unavailable"),
    ],
)
def test_mac_or_mac_key_of_another_generation_is_refused(store, keystore, encrypted, taken, code):
    paths, _ = encrypted
    other = json.loads((paths[1] / "manifest.json").read_bytes())["encryption"]
    document = read_logical(paths[2])
    for key in taken:
        document["encryption"][key] = other[key]
    reseal(paths[2], document)
    assert restore_codes(store, keystore) == [code]


def test_an_untampered_encrypted_generation_carries_a_mac_and_restores(store, keystore, encrypted):
    paths, weights = encrypted
    data = (paths[2] / "manifest.json").read_bytes()
    document = json.loads(data)
    section = document["encryption"]
    assert len(base64.b64decode(section["wrapped_mac_key"])) == 12 + 32 + 16
    # The MAC is the run key holder's keyed BLAKE3 over the manifest without the
    # self-digest and without the MAC itself.
    body = stored_authenticated_bytes(data, "gen")
    assert b"manifest_blake3" not in body and b"manifest_mac" not in body
    assert b"wrapped_mac_key" in body
    mac_key = LocalKeyStore(keystore).unwrap(
        "r",
        section["kek_id"],
        base64.b64decode(section["wrapped_mac_key"]),
        manifest_key_binding("r", document["generation_id"]),
    )
    assert manifest_mac(mac_key, body) == section["manifest_mac"]
    # The MAC key's context is not a file's: it never opens as a data key.
    from ckptvault.errors import KeyUnavailableError
    from ckptvault.trust.envelope import binding

    for name in document["files"]:
        with pytest.raises(KeyUnavailableError):
            LocalKeyStore(keystore).unwrap(
                "r",
                section["kek_id"],
                base64.b64decode(section["wrapped_mac_key"]),
                binding("r", document["generation_id"], name),
            )
    fresh = make_training_state(width=64, seed=9)
    with encrypted_manager(store, keystore) as mgr:
        info = mgr.restore(fresh)
    assert info.step == 2 and not info.skipped
    assert_same_tensors(model_snapshot(fresh["model"]), weights[2])


def _edit(name: str):
    def set_step(document: dict) -> None:
        document["step"] = 2  # the directory is renamed to agree (see the test)

    def swap_wrapped_keys(document: dict) -> None:
        files = document["encryption"]["files"]
        first, second = sorted(files)
        files[first], files[second] = files[second], files[first]

    return {
        "step": set_step,
        "created_at": lambda d: d.update(created_at="2020-01-01T00:00:00Z"),
        "parent": lambda d: d.update(parent=None if d["parent"] else d["generation_id"]),
        "contract": lambda d: d["contract"].update(dataset="ds-planted"),
        "writer": lambda d: d["writer"].update(world_size=8),
        "metrics": lambda d: d.update(metrics={"loss": 0.0}),
        "dcp": _swap_weight_and_moment,
        "unknown top-level key": lambda d: d.update(planted=True),
        "unknown encryption key": lambda d: d["encryption"].update(planted=True),
        "wrapped data keys": swap_wrapped_keys,
    }[name]


@pytest.mark.parametrize(
    "field",
    [
        "step",
        "created_at",
        "parent",
        "contract",
        "writer",
        "metrics",
        "dcp",
        "unknown top-level key",
        "unknown encryption key",
        "wrapped data keys",
    ],
)
def test_the_mac_covers_every_manifest_field(store, keystore, encrypted, field):
    """Each edit passes every structure check (resealed self-digest, names agree);
    only the MAC catches it, before a key is unwrapped or a byte decrypted. Format 3:
    an edit of ``dcp`` is an edit of an index, which the root covers by its digest;
    a root must be exactly what the writer writes, so an unknown key (top level or in
    the encryption section) is refused as invalid before the MAC is looked at (the
    MAC still covers them in format 2: the test after this one)."""
    paths, _ = encrypted
    shutil.rmtree(paths[2])  # the edited generation is the only candidate
    document = read_logical(paths[1])
    _edit(field)(document)
    reseal(paths[1], document)
    if field == "step":  # the directory name agrees with the edited step
        paths[1].rename(store / generation_dirname(document["step"], document["generation_id"]))
    with encrypted_manager(store, keystore) as mgr, pytest.raises(NoValidCheckpoint) as caught:
        mgr.restore(make_training_state(width=64, seed=9))
    expected = "manifest-invalid" if field.startswith("unknown") else "manifest-unauthenticated"
    assert [reason.split(":")[0] for _, _, reason in caught.value.rejected] == [expected]


@pytest.mark.parametrize("field", ["unknown top-level key", "unknown encryption key", "dcp"])
def test_the_mac_covers_unknown_keys_of_a_format_2_manifest(store, keystore, monkeypatch, field):
    """Format 2 accepts keys it does not define; the MAC covers them (and ``dcp``,
    which format 2 keeps in the manifest itself)."""
    with monkeypatch.context() as old:
        old.setattr(GenerationWriter, "format_version", 2)
        state = make_training_state(width=64)
        train_steps(state, 1)  # the optimizer has moments
        with encrypted_manager(store, keystore) as mgr:
            path = Path(mgr.save(1, state).result().path)
    document = read_logical(path)
    assert document["format_version"] == 2 and not list(path.glob("*-index.json"))
    _edit(field)(document)
    reseal(path, document)
    with encrypted_manager(store, keystore) as mgr, pytest.raises(NoValidCheckpoint) as caught:
        mgr.restore(make_training_state(width=64, seed=9))
    assert [reason.split(":")[0] for _, _, reason in caught.value.rejected] == [
        "manifest-unauthenticated"
    ]


def test_every_key_of_the_manifest_is_in_the_authenticated_bytes(encrypted):
    """Generically, for whatever keys a manifest holds now or later: changing any of
    them (top level or in the encryption section) changes what the MAC covers, except
    the self-digest and the MAC themselves."""
    paths, _ = encrypted
    document = json.loads((paths[2] / "manifest.json").read_bytes())
    base = authenticated_bytes(document)
    for key in document:
        edited = json.loads(json.dumps(document))
        edited[key] = ["edited"]
        assert (authenticated_bytes(edited) == base) == (key == "manifest_blake3"), key
    for key in document["encryption"]:
        edited = json.loads(json.dumps(document))
        edited["encryption"][key] = ["edited"]
        assert (authenticated_bytes(edited) == base) == (key == "manifest_mac"), key


@pytest.mark.parametrize("stripped", [("wrapped_mac_key", "manifest_mac"), ("manifest_mac",)])
def test_an_encrypted_generation_without_a_mac_is_refused(store, keystore, encrypted, stripped):
    """Stripping the MAC (or a generation written before manifests were
    authenticated): refused; half a MAC does not even parse."""
    paths, _ = encrypted
    document = read_logical(paths[2])
    for key in stripped:
        del document["encryption"][key]
    reseal(paths[2], document)
    expected = "manifest-unauthenticated" if len(stripped) == 2 else "manifest-invalid"
    assert restore_codes(store, keystore) == [expected]


def test_export_refuses_an_unauthenticated_manifest(store, keystore, encrypted, tmp_path):
    from ckptvault.ops.export import export_weights

    paths, _ = encrypted
    document = read_logical(paths[2])
    _swap_weight_and_moment(document)
    reseal(paths[2], document)
    with pytest.raises(NoValidCheckpoint, match="manifest-unauthenticated"):
        export_weights(
            store, 2, tmp_path / "w.safetensors", run_id="r", keystore=LocalKeyStore(keystore)
        )
