"""Hostile stores: planted headers, manifests and layouts that target the parsers and
the allocator before anything is verified (DESIGN rule 5).

Every attack runs against a real store on disk, as someone who can write the store
but holds no signing key: the attacker rewrites files and then the manifest's
digests and self-digest to match. The secure outcome is always the same: the
generation is skipped with a reason code, the next one is restored, nothing raw
(RecursionError, OverflowError, MemoryError, RuntimeError, ValueError) escapes,
``ckptvault verify`` reports FAIL with the code (exit 1) and no command prints a
traceback.

Attacks on the manifest's tensor metadata run against format 3 (the root's tensor
table, the index's chunks) and format 2 (its ``dcp`` section), which the reader still
accepts and so an attacker can still plant. Chunk layouts and format 3's indexes are
in ``test_hostile_layouts.py``.
"""

from __future__ import annotations

import json
import struct
import tracemalloc
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import (
    FormatError,
    UnsupportedValueError,
)
from ckptvault.format.container import MAGIC
from ckptvault.format.manifest import MAX_MANIFEST_BYTES
from ckptvault.storage.posix.store import PosixStore
from ckptvault.trust.checks import verify_generation
from support.common import (
    assert_same_tensors,
    make_training_state,
    model_snapshot,
    only_tensor_file,
    run_cli,
    writable,
)
from support.hostile_forging import forge_manifest, forge_root, writer_format
from support.hostile_inputs import (
    FORMATS,
    FQN,
    assert_verify_fails,
    deep,
    encrypted_tensor_file,
    nested,
    replace_header,
    restore_skipping,
    save_two_steps,
    tensor_file_parts,
)

# -- forging, as an attacker without the signing key ----------------------------------
# forge_manifest (hostile_forging): the logical manifest edited, every digest refreshed.








# -- restoring, and what the user sees ------------------------------------------------




@pytest.fixture
def two_steps(store: Path) -> tuple[dict[int, Path], dict[int, dict]]:
    return save_two_steps(store)








# -- 1. parse errors skip the generation ----------------------------------------------


def test_deeply_nested_tensor_file_header(store, two_steps):
    paths, _ = two_steps
    replace_header(only_tensor_file(paths[2]), deep(20_000).encode())
    forge_manifest(paths[2])
    restore_skipping(store, "tensor-file-invalid", "deeper than 64 levels")
    assert_verify_fails(store, "tensor-file-invalid")


@pytest.mark.parametrize(
    "shape",
    ["[Infinity,8]", "[1e999,8]", "[16.0,8]", "[true,8]", "[-16,8]", "[1" + "0" * 30 + ",8]"],
)
def test_malformed_shape_in_a_tensor_file_header(store, two_steps, shape):
    paths, _ = two_steps
    file = only_tensor_file(paths[2])
    header = json.loads(tensor_file_parts(file)[0])
    name = next(n for n in header if n != "__metadata__")
    header[name]["shape"] = "@shape@"
    text = json.dumps(header, separators=(",", ":")).replace('"@shape@"', shape)
    replace_header(file, text.encode())
    forge_manifest(paths[2])
    restore_skipping(store, "tensor-file-invalid")


def test_malformed_shape_in_a_tensor_file_header_cli(store, two_steps):
    paths, _ = two_steps
    file = only_tensor_file(paths[2])
    header = json.loads(tensor_file_parts(file)[0])
    name = next(n for n in header if n != "__metadata__")
    header[name]["shape"] = "@shape@"
    replace_header(file, json.dumps(header).replace('"@shape@"', "[Infinity]").encode())
    forge_manifest(paths[2])
    assert_verify_fails(store, "tensor-file-invalid")


def test_deeply_nested_manifest(store, two_steps):
    paths, _ = two_steps
    forge_manifest(paths[2], lambda m: m.update(contract="@deep@"), {"@deep@": deep(50_000)})
    restore_skipping(store, "manifest-invalid", "deeper than 128 levels")
    assert_verify_fails(store, "manifest-invalid")


@FORMATS
@pytest.mark.parametrize(
    "shape", ["[Infinity,8]", "[16.5,8]", "[false,8]", "[-16,8]", "[99999999999999999999999,8]"]
)
def test_malformed_shape_in_the_manifest(store, version, shape):
    """In the root's tensor table (format 3) or the dcp section (format 2)."""
    paths, _ = save_two_steps(store, version)
    raw = {"@shape@": shape}
    if version == 3:
        forge_root(paths[2], lambda root: root["tensors"][FQN].update(shape="@shape@"), raw)
    else:
        forge_manifest(paths[2], lambda m: m["dcp"]["tensors"][FQN].update(shape="@shape@"), raw)
    restore_skipping(store, "manifest-invalid")


@FORMATS
@pytest.mark.parametrize("field", ["offsets", "sizes", "start", "length"])
def test_malformed_chunk_numbers_in_the_manifest(store, version, field):
    """In the chunk as the index (format 3) or the dcp section (format 2) holds it."""
    paths, _ = save_two_steps(store, version)
    bad = {"offsets": [0.0, 0], "sizes": [16, True], "start": -8, "length": 2**70}[field]

    def change(manifest: dict) -> None:
        manifest["dcp"]["tensors"][FQN]["chunks"][0][field] = bad

    forge_manifest(paths[2], change)
    restore_skipping(store, "manifest-invalid")


@pytest.fixture(params=[3, 2], ids=["format-3", "format-2"])
def encrypted_steps(store: Path, tmp_path: Path, request) -> tuple[dict[int, Path], Path]:
    keystore = tmp_path / "keys"
    paths, _ = save_two_steps(store, request.param, keystore=keystore, segment_size=4096)
    return paths, keystore




def test_deeply_nested_container_header(store, encrypted_steps):
    paths, keystore = encrypted_steps
    file = encrypted_tensor_file(paths[2])
    data = file.read_bytes()
    (length,) = struct.unpack("<I", data[8:12])
    header = deep(20_000).encode()
    writable(file).write_bytes(
        MAGIC + struct.pack("<I", len(header)) + header + data[12 + length :]
    )
    forge_manifest(paths[2])
    restore_skipping(store, "tensor-file-invalid", "deeper than 64 levels", keystore=keystore)
    assert_verify_fails(store, "tensor-file-invalid")


@pytest.mark.parametrize("claim_the_bytes", [False, True])
def test_huge_shape_in_an_encrypted_run_allocates_nothing(store, encrypted_steps, claim_the_bytes):
    """Encrypted files have no plaintext header to compare at structure time: the
    manifest's shape alone once sized the restore's buffers (torch.empty of 35 TB)."""
    paths, keystore = encrypted_steps
    huge = 2**40

    def change(manifest: dict) -> None:
        info = manifest["dcp"]["tensors"]["model/fc1.weight"]
        info["shape"] = info["chunks"][0]["sizes"] = [huge, 8]
        if claim_the_bytes:  # a consistent length: then it cannot fit the container
            info["chunks"][0]["length"] = huge * 8 * 4

    forge_manifest(paths[2], change)
    restore_skipping(store, "manifest-inconsistent", keystore=keystore)
    assert_verify_fails(store, "manifest-inconsistent")


@FORMATS
def test_two_tensors_cannot_claim_the_same_bytes(store, version):
    """Chunks of different tensors pointing at one entry would make a reader allocate
    the file's bytes many times over."""
    with writer_format(version), cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"a": torch.ones(64, 4), "b": torch.zeros(64, 4)})
        path = Path(mgr.save(2, {"a": torch.ones(64, 4), "b": torch.zeros(64, 4)}).result().path)

    def change(manifest: dict) -> None:
        tensors = manifest["dcp"]["tensors"]
        tensors["b"]["chunks"] = [dict(tensors["a"]["chunks"][0])]

    forge_manifest(path, change)
    fresh = {"a": torch.empty(64, 4), "b": torch.empty(64, 4)}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(fresh)
    assert info.step == 1 and info.skipped[0].reason.startswith("manifest-inconsistent")
    assert "share bytes" in info.skipped[0].reason
    assert torch.equal(fresh["b"], torch.zeros(64, 4))


# -- 2. memory spent before verification ----------------------------------------------


def test_header_is_verified_before_it_is_parsed(store, two_steps):
    """Same size, new bytes, digests not refreshed: the digest check refuses them
    before the JSON parser ever runs (a deep header would otherwise be parsed)."""
    paths, _ = two_steps
    file = only_tensor_file(paths[2])
    header, _ = tensor_file_parts(file)
    replace_header(file, deep(len(header) // 2).encode() + b" " * (len(header) % 2))
    info = restore_skipping(store, "digest-mismatch")
    assert "do not match the manifest digest" in info.skipped[0].reason


def test_oversized_header_is_refused_unread(store, two_steps):
    """An 8 MiB junk header (digests refreshed) is refused from its length prefix:
    no larger than the file's entries need, and nothing of it is read or parsed."""
    paths, _ = two_steps
    replace_header(only_tensor_file(paths[2]), b"[" + b"0," * (4 * 1024 * 1024) + b"0]")
    forge_manifest(paths[2])
    restore_skipping(store, "tensor-file-invalid", "larger than")
    ref = PosixStore(store).list_generations()[0]
    tracemalloc.start()
    try:
        report = verify_generation(PosixStore(store), ref)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [p.code for p in report.problems] == ["tensor-file-invalid"]
    assert peak < 8 * 1024 * 1024  # less than the header itself; it was ~25x that


def test_oversized_manifest_is_refused_unread(store, two_steps, monkeypatch):
    paths, _ = two_steps
    manifest = writable(paths[2] / "manifest.json")
    manifest.write_bytes(b" " * (MAX_MANIFEST_BYTES + 1))

    def no_reads(*args, **kwargs):
        raise AssertionError("an oversized manifest was read")

    original = PosixStore.read_bytes

    def read_bytes(self, ref, name, limit):
        if ref.step == 2:
            no_reads()
        return original(self, ref, name, limit)

    monkeypatch.setattr(PosixStore, "read_bytes", read_bytes)
    restore_skipping(store, "manifest-invalid", "64 MiB")
    monkeypatch.undo()
    assert_verify_fails(store, "manifest-invalid")




@pytest.mark.parametrize(("version", "cap"), [(3, "32 MiB"), (2, "64 MiB")])
def test_saving_refuses_what_readers_would_refuse(store, version, cap):
    """The bounds are the writer's too: a save never publishes a generation that
    restore would have to refuse (a format-3 root is capped at 32 MiB, a format-2
    manifest at 64)."""
    with writer_format(version), cv.CheckpointManager(store, run_id="r") as mgr:
        with pytest.raises(UnsupportedValueError, match="nested more than 32 levels"):
            mgr.save(1, {"meta": nested(40)})
        with pytest.raises(FormatError, match=cap):
            mgr.save(1, {"meta": {"blob": bytes(50 * 1024 * 1024)}}).result()
        assert mgr.generations() == []
        mgr.save(1, {"meta": nested(31)})
    fresh = {"meta": nested(31)}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert mgr.restore(fresh).step == 1


def test_listing_parses_no_manifest(store, two_steps, monkeypatch):
    paths, _ = two_steps
    with cv.CheckpointManager(store, run_id="r") as mgr:
        before = [info.to_json() for info in mgr.generations()]
    writable(paths[2] / "manifest.json").write_bytes(deep(5_000_000).encode())

    def refuse(*args, **kwargs):
        raise AssertionError("listing opened a file")

    for method in ("open_file", "read_bytes", "read_range"):
        monkeypatch.setattr(PosixStore, method, refuse)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        after = [info.to_json() for info in mgr.generations()]
    assert after == before  # sizes from the listing, times from the generation ids
    assert [set(entry) for entry in after] == [
        {"step", "generation_id", "path", "bytes", "created_at"}
    ] * 2
    monkeypatch.undo()
    listed = run_cli("ls", str(store), "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == before


def test_listed_size_and_time_match_what_save_returned(store):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        saved = mgr.save(1, make_training_state()).result()
        (listed,) = mgr.generations()
    assert listed == saved


def test_restored_weights_are_intact_after_all_this(store, two_steps):
    """The bounded parsers accept what ckptvault writes."""
    _, weights = two_steps
    fresh = make_training_state(seed=3)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(fresh)
    assert info.step == 2 and info.skipped == []
    assert_same_tensors(model_snapshot(fresh["model"]), weights[2])
