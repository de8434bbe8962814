"""Warm start from Hugging Face weights: a save_pretrained directory (one file or
shards with an index) or one .safetensors file, read only, checked against hostile
input before anything is applied, each file's BLAKE3 digest in the run's lineage."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from blake3 import blake3
from safetensors.torch import save_file

import ckptvault as cv
from ckptvault.errors import FormatError, UsageError
from support.doc_pages import line_containing

transformers = pytest.importorskip("transformers")


def tiny_gpt2(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=32, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def _equal(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _digests(directory: Path) -> set[tuple[str, str]]:
    return {(p.name, blake3(p.read_bytes()).hexdigest()) for p in directory.glob("*.safetensors")}


@pytest.mark.parametrize("shard", [None, "4KB"], ids=["one-file", "sharded"])
def test_a_save_pretrained_directory_starts_a_run(tmp_path: Path, shard: str | None):
    source = tiny_gpt2(seed=1)
    pretrained = tmp_path / "pretrained"
    options = {"max_shard_size": shard} if shard else {}
    source.save_pretrained(pretrained, safe_serialization=True, **options)
    assert (pretrained / "model.safetensors.index.json").exists() == (shard is not None)
    before = {p.name: p.stat().st_mtime_ns for p in pretrained.iterdir()}

    model = tiny_gpt2(seed=2)
    optimizer = torch.optim.AdamW(model.parameters())
    state = {"model": model, "optim": optimizer, "step": 0}
    with cv.CheckpointManager(tmp_path / "store", run_id="fine-tune") as mgr:
        info = mgr.warm_start(state, pretrained)
        assert _equal(model, source)
        # save_pretrained writes one of each tie; the head is still the embedding.
        assert model.lm_head.weight is model.transformer.wte.weight
        assert info.lineage is not None and info.lineage.store == str(pretrained)
        assert set(info.lineage.files) == _digests(pretrained)
        mgr.save(1, state)
    with cv.CheckpointManager(tmp_path / "store", run_id="fine-tune") as mgr:
        again = tiny_gpt2(seed=3)
        live = {"model": again, "optim": torch.optim.AdamW(again.parameters()), "step": None}
        resumed = mgr.restore(live)
    assert resumed is not None and resumed.lineage == info.lineage  # recorded in the run
    assert {p.name: p.stat().st_mtime_ns for p in pretrained.iterdir()} == before  # read only


def test_one_safetensors_file_with_a_rename(tmp_path: Path):
    torch.manual_seed(0)
    source = torch.nn.Linear(4, 3)
    path = tmp_path / "encoder.safetensors"
    save_file({f"encoder.{k}": v for k, v in source.state_dict().items()}, path)
    live = torch.nn.Linear(4, 3)
    with cv.CheckpointManager(tmp_path / "store", run_id="r") as mgr:
        with pytest.raises(cv.errors.StateMismatchError):
            mgr.warm_start({"model": live}, path)  # names differ: strict refuses
        info = mgr.warm_start({"model": live}, path, rename={"encoder.": ""})
    assert _equal(live, source) and info.renamed


def _write_hostile(path: Path, header: bytes, data: bytes) -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


@pytest.mark.parametrize(
    ("header", "data", "says"),
    [
        (
            b'{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
            b"\0" * 4,
            "tensor data ends at byte",
        ),
        (
            b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
            b'"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}',
            b"\0" * 12,
            "gap or overlap",
        ),
        (b'{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}', b"\0" * 8, "size does not"),
    ],
    ids=["wrong-size", "overlapping", "shape-vs-bytes"],
)
def test_a_hostile_safetensors_file_is_refused_and_nothing_applied(
    tmp_path: Path, header: bytes, data: bytes, says: str
):
    path = tmp_path / "hostile.safetensors"
    _write_hostile(path, header, data)
    live = torch.nn.Linear(2, 1)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with (
        cv.CheckpointManager(tmp_path / "store", run_id="r") as mgr,
        pytest.raises(FormatError, match=says),
    ):
        mgr.warm_start({"model": live}, path)
    assert all(torch.equal(before[k], v) for k, v in live.state_dict().items())


def test_a_huge_header_is_refused_before_it_is_read(tmp_path: Path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with (
        cv.CheckpointManager(tmp_path / "store", run_id="r") as mgr,
        pytest.raises(FormatError, match="header length"),
    ):
        mgr.warm_start({"model": torch.nn.Linear(2, 1)}, path)


def test_an_index_naming_files_outside_or_missing_tensors_is_refused(tmp_path: Path):
    directory = tmp_path / "pretrained"
    directory.mkdir()
    save_file({"weight": torch.ones(1, 2), "bias": torch.ones(1)}, directory / "part.safetensors")
    (tmp_path / "secret.safetensors").write_bytes(b"not weights")
    index = directory / "model.safetensors.index.json"
    live = {"model": torch.nn.Linear(2, 1)}
    with cv.CheckpointManager(tmp_path / "store", run_id="r") as mgr:
        for weight_map, says in [
            ({"weight": "../secret.safetensors"}, "not a plain file name"),
            ({"weight": "part.safetensors", "bias": "gone.safetensors"}, "not there"),
            ({"weight": "part.safetensors"}, "does not place there"),
            (
                {"weight": "part.safetensors", "bias": "part.safetensors", "x": "part.safetensors"},
                "no file holds",
            ),
        ]:
            index.write_text(json.dumps({"weight_map": weight_map}))
            with pytest.raises(FormatError, match=says):
                mgr.warm_start(live, directory)
        os.symlink(tmp_path / "secret.safetensors", directory / "link.safetensors")
        index.write_text(json.dumps({"weight_map": {"weight": "link.safetensors"}}))
        with pytest.raises(FormatError, match="not a regular file"):
            mgr.warm_start(live, directory)
        with pytest.raises(UsageError, match="needs source_run_id"):
            mgr.warm_start(live, tmp_path / "no-such-store")


def test_a_sparse_file_claiming_terabytes_is_refused_before_memory_is_taken(tmp_path: Path):
    """A header describing 1 TiB of weights over a sparse file: refused before a
    byte of it is allocated (it would have been a MemoryError, untyped)."""
    header = b'{"w":{"dtype":"U8","shape":[1099511627776],"data_offsets":[0,1099511627776]}}'
    path = tmp_path / "sparse.safetensors"
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(8 + len(header) + (1 << 40))
    with (
        cv.CheckpointManager(tmp_path / "store", run_id="r") as mgr,
        pytest.raises(FormatError, match="sparse file"),
    ):
        mgr.warm_start({"model": torch.nn.Linear(2, 1)}, path)


def test_the_readme_line_runs_as_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The docs' "Starting from another run": the Hugging Face line, verbatim."""
    line = line_containing('mgr.warm_start(state, "pretrained/gpt2-small")')
    monkeypatch.chdir(tmp_path)
    source = tiny_gpt2(seed=1)
    source.save_pretrained("pretrained/gpt2-small")
    model = tiny_gpt2(seed=2)
    state = {"model": model, "optim": torch.optim.AdamW(model.parameters())}
    with cv.CheckpointManager("runs/ft", run_id="ft") as mgr:
        scope = {"mgr": mgr, "state": state}
        exec(compile(line.strip(), "docs", "exec"), scope)
        assert scope["info"].lineage.store == "pretrained/gpt2-small"
        assert _equal(model, source)
        mgr.save(1, state)  # the next start resumes the run instead
        exec(compile(line.strip(), "docs", "exec"), scope)
        assert scope["info"].step == 1


@pytest.mark.parametrize(
    "files",
    [[["a.safetensors"]], [["a", 1]], "a", [["x" * 2000, "d"]], [["a", "d"]] * 10_001],
    ids=["short-pair", "not-text", "not-a-list", "too-long", "too-many"],
)
def test_a_malformed_lineage_file_list_is_not_carried(files: object):
    """A manifest's contract is signed and verified before it is read, but its
    lineage is carried on into every later manifest only when well formed and small."""
    record = {"run_id": "", "step": 0, "generation_id": "", "store": "p", "files": files}
    assert cv.restoring.lineage.Lineage.from_contract({"lineage": record}) is None
    record["files"] = [["a.safetensors", "ab" * 32]]
    assert cv.restoring.lineage.Lineage.from_contract({"lineage": record}) is not None


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_file_swapped_after_its_check_is_refused_without_blocking_or_leaking(
    tmp_path: Path, kind: str
):
    """What the read meets when a checked weights file is swapped (for a FIFO no
    writer will ever open, or a directory) before it is opened: refused as not a
    regular file, without blocking, and its descriptor closed."""
    from ckptvault.restoring.hf_weights import _read_file

    path = tmp_path / "model.safetensors"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    open_before = len(os.listdir("/proc/self/fd"))
    for follow in (True, False, True):
        with pytest.raises(FormatError, match="not a regular file"):
            _read_file(path, follow=follow)
    assert len(os.listdir("/proc/self/fd")) == open_before
