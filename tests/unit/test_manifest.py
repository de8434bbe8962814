"""The manifest: canonical bytes, required keys, digests that match, no absolute paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from blake3 import blake3

import ckptvault as cv
from ckptvault.errors import FormatError, NoValidCheckpoint
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.manifest import FORMAT_VERSION, parse_manifest
from ckptvault.state.codec import decode_plain
from support.common import make_training_state, run_cli, train_steps, writable


def _save(store: Path, step: int = 1, **kwargs) -> tuple[Path, dict]:
    state = make_training_state()
    train_steps(state, 2)
    with cv.CheckpointManager(store, run_id="run42", **kwargs) as mgr:
        path = Path(mgr.save(step, state).result().path)
    return path, json.loads((path / "manifest.json").read_bytes())


def test_manifest_is_canonical_and_complete(store: Path):
    path, manifest = _save(
        store, contract={"config": {"lr": 0.01, "layers": 2}, "dataset": "ds-v3"}
    )
    raw = (path / "manifest.json").read_bytes()
    assert dumps_canonical(json.loads(raw)) == raw
    for key in (
        "format_version",
        "run_id",
        "step",
        "generation_id",
        "created_at",
        "parent",
        "files",
        "chunk_size",
        "indexes",
        "tensors",
        "dcp_version",
        "state",
        "contract",
    ):
        assert key in manifest
    # Format 3: the root holds the tensor table and names the indexes; no DCP chunks.
    assert manifest["format_version"] == FORMAT_VERSION == 3 and "dcp" not in manifest
    assert manifest["run_id"] == "run42" and manifest["step"] == 1
    assert path.name == f"step-{1:012d}.{manifest['generation_id']}"
    contract = manifest["contract"]
    assert contract["fields"]["dataset"] == "ds-v3"
    assert contract["fields"]["config"] == {"layers": 2, "lr": 0.01}
    assert contract["versions"]["torch"] == torch.__version__
    assert "python" in contract["versions"] and "ckptvault" in contract["versions"]
    assert "code_revision" in contract
    # The JSON leaves and the tensor table live in the root, the DCP chunk metadata
    # in the index it names.
    assert decode_plain(manifest["state"]["meta"], "test")["tokens_seen"] == 8
    assert "model/fc1.weight" in manifest["tensors"]
    assert list(manifest["indexes"]) == ["r00000-index.json"]
    index = json.loads((path / "r00000-index.json").read_bytes())
    assert "model/fc1.weight" in index["tensors"]


def test_file_digests_match_bytes_and_chunks(store: Path):
    path, manifest = _save(store, chunk_size=1024)
    chunk_size = manifest["chunk_size"]
    assert chunk_size == 1024
    assert set(manifest["files"]) == {p.name for p in path.iterdir()} - {
        "manifest.json",
        "r00000-index.json",
    }
    assert set(manifest["indexes"]) == {"r00000-index.json"}
    assert manifest["format_version"] == 3
    index_bytes = (path / "r00000-index.json").read_bytes()
    assert manifest["indexes"]["r00000-index.json"] == {
        "size": len(index_bytes),
        "blake3": blake3(index_bytes).hexdigest(),
    }
    index = json.loads(index_bytes)
    assert set(index["files"]) == set(manifest["files"])
    for name, record in manifest["files"].items():
        # The documented check, with nothing but the blake3 package: each byte hashed
        # once, in its chunk; the chunk digests in the rank's index; the whole-file
        # digest (in the root) derived from them.
        assert set(record) == {"size", "blake3"}
        data = (path / name).read_bytes()
        assert record["size"] == len(data)
        chunks = [
            blake3(data[i : i + chunk_size]).hexdigest() for i in range(0, len(data), chunk_size)
        ]
        assert index["files"][name] == chunks and len(chunks) > 1
        whole = blake3(b"ckptvault file digest v2\0" + len(data).to_bytes(8, "little"))
        whole.update(b"".join(bytes.fromhex(digest) for digest in chunks))
        assert record["blake3"] == whole.hexdigest()


def test_no_absolute_paths_and_store_is_relocatable(tmp_path: Path):
    store = tmp_path / "original"
    path, _ = _save(store)
    text = (path / "manifest.json").read_text()
    assert str(tmp_path) not in text and '"/' not in text
    moved = tmp_path / "moved"
    store.rename(moved)
    fresh = make_training_state(seed=3)
    with cv.CheckpointManager(moved, run_id="run42") as mgr:
        info = mgr.restore(fresh)
    assert info is not None and info.path.startswith(str(moved))


def test_large_contract_fields_are_hashed(store: Path):
    big = {"vocab": [f"token{i}" for i in range(5000)]}
    _, manifest = _save(store, contract={"tokenizer": big, "dataset": "small"})
    stored = manifest["contract"]["fields"]["tokenizer"]
    assert set(stored) == {"$blake3", "bytes"}
    assert manifest["contract"]["fields"]["dataset"] == "small"


def test_parent_links_saves_and_restores(store: Path):
    state = make_training_state()
    with cv.CheckpointManager(store, run_id="r") as mgr:
        first = mgr.save(1, state).result()
        second = mgr.save(2, state).result()
    manifests = {
        info.generation_id: json.loads((Path(info.path) / "manifest.json").read_bytes())
        for info in (first, second)
    }
    assert manifests[first.generation_id]["parent"] is None
    assert manifests[second.generation_id]["parent"] == first.generation_id
    with cv.CheckpointManager(store, run_id="r") as mgr:
        restored = mgr.restore(state, step=1)
        third = mgr.save(3, state).result()
    assert (
        json.loads((Path(third.path) / "manifest.json").read_bytes())["parent"]
        == restored.generation_id
    )


def _rewrite_manifest(path: Path, change) -> None:
    manifest = json.loads((path / "manifest.json").read_bytes())
    change(manifest)
    writable(path / "manifest.json").write_bytes(dumps_canonical(manifest))


def test_newer_format_version_names_both_versions(store: Path):
    state = make_training_state()
    with cv.CheckpointManager(store, run_id="r") as mgr:
        old = mgr.save(1, state).result()
        new = mgr.save(2, state).result()
    _rewrite_manifest(Path(new.path), lambda m: m.update(format_version=99))
    with pytest.raises(FormatError, match=rf"format version 99.*up to {FORMAT_VERSION}"):
        parse_manifest((Path(new.path) / "manifest.json").read_bytes(), "gen")
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(make_training_state())
    assert info.generation_id == old.generation_id
    assert info.skipped[0].generation_id == new.generation_id
    assert "format-unsupported" in info.skipped[0].reason and "99" in info.skipped[0].reason
    with (
        cv.CheckpointManager(store, run_id="r") as mgr,
        pytest.raises(NoValidCheckpoint, match="99"),
    ):
        mgr.restore(make_training_state(), step=2)


def test_non_canonical_or_edited_manifest_is_refused(store: Path):
    state = make_training_state()
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, state)
        new = mgr.save(2, state).result()
    raw = json.loads((Path(new.path) / "manifest.json").read_bytes())
    writable(Path(new.path) / "manifest.json").write_text(json.dumps(raw, indent=1))
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(make_training_state())
    assert info.step == 1 and "manifest-invalid" in info.skipped[0].reason
    assert "canonical" in info.skipped[0].reason


def test_generations_of_format_version_1_still_verify_and_restore(
    store: Path, monkeypatch: pytest.MonkeyPatch
):
    """Format 1 recorded BLAKE3 over each file's bytes as its whole-file digest;
    format 2 on derives it from the chunk digests. A store holding a format-1 generation
    (a single manifest, no indexes) and a current one verifies and restores both, and
    a flipped byte in the old one is still caught."""
    import dataclasses
    import functools

    from ckptvault.io import writer as writer_module
    from ckptvault.saving.generation_writer import GenerationWriter
    from ckptvault.trust.digests import FileDigester

    build = GenerationWriter.build_manifest
    with monkeypatch.context() as legacy:  # what ckptvault wrote before format 2
        legacy.setattr(GenerationWriter, "format_version", 2)  # one manifest, no indexes
        legacy.setattr(
            writer_module, "FileDigester", functools.partial(FileDigester, derived=False)
        )
        legacy.setattr(
            GenerationWriter,
            "build_manifest",
            lambda self, *a, **k: dataclasses.replace(build(self, *a, **k), format_version=1),
        )
        with cv.CheckpointManager(store, run_id="r") as mgr:
            old = mgr.save(1, {"w": torch.arange(1000.0)}).result()
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(2, {"w": torch.arange(1000.0) * 2})
    old_manifest = json.loads((Path(old.path) / "manifest.json").read_text())
    assert old_manifest["format_version"] == 1
    ((name, record),) = old_manifest["files"].items()
    assert record["blake3"] == blake3((Path(old.path) / name).read_bytes()).hexdigest()
    assert run_cli("verify", str(store), "--all").returncode == 0
    restored = {"w": torch.zeros(1000)}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert mgr.restore(restored, step=1).step == 1
    assert torch.equal(restored["w"], torch.arange(1000.0))
    data = bytearray((Path(old.path) / name).read_bytes())
    data[-7] ^= 1
    writable(Path(old.path) / name).write_bytes(bytes(data))
    assert run_cli("verify", str(store), "--step", "1").returncode != 0
