"""The single-process write path (``ckptvault.io.direct_write``): no DCP planning,
the layout kept between saves, and exactly what the DCP path writes.

Real saves into real POSIX stores; the DCP path is reached by taking the direct
writer out (it declines, as it does for tensors only DCP can lay out).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.manifest import parse_manifest
from ckptvault.io import direct_write, writer
from ckptvault.io.direct_write import DirectWriter, layout_key
from ckptvault.saving.generation_writer import GenerationWriter
from ckptvault.saving.indexes import IndexWriter
from ckptvault.storage import open_store
from ckptvault.trust.checks import check_structure
from support.forging import read_logical


def mixed_state(seed: int = 0) -> dict[str, object]:
    """Tensors of every width, a 0-dim one, an empty one, a non-contiguous one,
    one that requires grad, and many small ones."""
    gen = torch.Generator().manual_seed(seed)
    small = {f"layer{i}.bias": torch.randn(7, generator=gen) for i in range(40)}
    return {
        "model": {
            **small,
            "embed": torch.randn(300, 64, generator=gen).to(torch.bfloat16),
            "head": torch.randn(64, 300, generator=gen).t(),  # not contiguous
            "counts": torch.randint(0, 1 << 40, (33,), generator=gen),
            "mask": torch.rand(17, generator=gen) > 0.5,
            "scale": torch.tensor(0.5, dtype=torch.float64),
            "nothing": torch.empty(0, 4),
            "param": torch.nn.Parameter(torch.randn(5, 5, generator=gen)),
        },
        "step": 3,
    }


def saved(root: Path, state: dict[str, object], *, direct: bool, **options: object) -> Path:
    """Save ``state`` once; returns the generation's directory."""
    with pytest.MonkeyPatch.context() as patch:
        if not direct:
            patch.setattr(DirectWriter, "write", lambda *args, **kwargs: None)
        with cv.CheckpointManager(root, run_id="r", **options) as mgr:
            info = mgr.save(1, state).result()
    return Path(info.path)


def tensor_files(generation: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in generation.iterdir() if ".safetensors" in p.name}


@pytest.mark.parametrize("threads", [1, 3])
def test_writes_exactly_what_the_dcp_path_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    # Small files, so that three writer threads make three files of this small state.
    for module in (writer, direct_write):
        monkeypatch.setattr(module, "MIN_FILE_BYTES", 16 * 1024)
    state = mixed_state()
    fast = saved(tmp_path / "fast", state, direct=True, threads=threads)
    planned = saved(tmp_path / "dcp", state, direct=False, threads=threads)
    fast_files, dcp_files = tensor_files(fast), tensor_files(planned)
    assert len(fast_files) == threads and fast_files == dcp_files  # byte for byte
    # The root's sections, and the logical manifest (the indexes merged in: chunk
    # digests and DCP chunk metadata); the index bytes differ only by generation id.
    fast_root = json.loads((fast / "manifest.json").read_bytes())
    dcp_root = json.loads((planned / "manifest.json").read_bytes())
    for section in ("tensors", "dcp_version", "state", "files"):
        assert fast_root[section] == dcp_root[section], section
    assert set(fast_root["indexes"]) == set(dcp_root["indexes"]) == {"r00000-index.json"}
    fast_manifest, dcp_manifest = read_logical(fast), read_logical(planned)
    for section in ("dcp", "files"):
        assert fast_manifest[section] == dcp_manifest[section], section

    restored = mixed_state(seed=1)
    with cv.CheckpointManager(tmp_path / "fast", run_id="r") as mgr:
        assert mgr.restore(restored).step == 1
    for key, tensor in state["model"].items():  # type: ignore[attr-defined]
        assert torch.equal(restored["model"][key], tensor), key  # type: ignore[index]


def test_the_layout_is_planned_once_while_it_does_not_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans = []
    plan_layout = direct_write.plan_layout

    def counted(*args: object) -> direct_write.DirectLayout:
        plans.append(args)
        return plan_layout(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(direct_write, "plan_layout", counted)
    state = {"w": torch.zeros(4, 4), "b": torch.zeros(4)}
    with cv.CheckpointManager(tmp_path / "s", run_id="r") as mgr:
        for step in (1, 2, 3):
            state["w"].fill_(step)
            mgr.save(step, state)
        assert len(plans) == 1
        state["b"] = torch.zeros(5)  # a new shape: a new layout
        mgr.save(4, state)
        state["b"] = torch.zeros(5, dtype=torch.float64)  # a new dtype too
        mgr.save(5, state)
        assert len(plans) == 3
        for step, width, dtype in ((3, 4, torch.float32), (5, 5, torch.float64)):
            back = {"w": torch.empty(4, 4), "b": torch.empty(width, dtype=dtype)}
            mgr.restore(back, step=step)
            assert torch.equal(back["w"], torch.full((4, 4), 3.0))  # filled last at step 3
            assert back["b"].shape == (width,) and back["b"].dtype == dtype


def test_the_kept_manifest_section_is_used_only_for_its_own_object(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Format 2: the ``dcp`` section is encoded once per layout; a manifest built from
    other metadata never carries those bytes, and either way the bytes are canonical.
    Format 3 keeps ``dcp`` out of the root: what is kept per layout is the index plan
    (tensor table and each index's chunk list), and it too serves only the ``dcp``
    object it was made from."""
    with monkeypatch.context() as old:
        old.setattr(GenerationWriter, "format_version", 2)
        generation = saved(tmp_path / "s", {"w": torch.ones(3)}, direct=True)
    data = (generation / "manifest.json").read_bytes()
    manifest = parse_manifest(data, "test")
    assert manifest.format_version == 2
    kept = dataclasses.replace(manifest, encoded_dcp=(manifest.dcp, dumps_canonical(manifest.dcp)))
    assert kept.to_bytes() == data == manifest.to_bytes()
    other = {"version": None, "tensors": {}}
    stale = dataclasses.replace(kept, dcp=other)  # the kept bytes belong to another object
    assert json.loads(stale.to_bytes())["dcp"] == other
    assert (
        stale.authenticated_bytes()
        == dataclasses.replace(manifest, dcp=other).authenticated_bytes()
    )

    generation = saved(tmp_path / "s3", {"w": torch.ones(3)}, direct=True)
    data = (generation / "manifest.json").read_bytes()
    opened = open_store(tmp_path / "s3", must_exist=True)
    whole = check_structure(opened, opened.list_generations()[0]).manifest
    assert whole.format_version == 3 and "w" in whole.dcp["tensors"]
    writer = IndexWriter()
    area = MemoryArea()
    rewritten = writer.write(area, whole)  # plans this layout, and keeps the plan
    assert rewritten.to_bytes() == data
    assert area.files == {"r00000-index.json": (generation / "r00000-index.json").read_bytes()}
    stale_area, fresh_area = MemoryArea(), MemoryArea()
    stale = writer.write(stale_area, dataclasses.replace(whole, dcp=other))
    fresh = IndexWriter().write(fresh_area, dataclasses.replace(whole, dcp=other))
    assert stale_area.files == fresh_area.files and stale.to_bytes() == fresh.to_bytes()
    assert json.loads(stale_area.files["r00000-index.json"])["tensors"] == {}
    assert json.loads(stale.to_bytes())["tensors"] == {}


class MemoryArea:
    """A staging area that keeps what is written to it in memory."""

    generation_id = "memory"

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def create_file(self, name: str) -> MemorySink:
        return MemorySink(self.files, name)


class MemorySink:
    def __init__(self, files: dict[str, bytes], name: str) -> None:
        self.files, self.name = files, name
        files[name] = b""

    def write(self, data: bytes) -> None:
        self.files[self.name] += bytes(data)

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        del self.files[self.name]


def test_tensors_only_dcp_can_lay_out_are_left_to_it() -> None:
    class Tagged(torch.Tensor):
        pass

    plain = {"a": torch.zeros(2), "p": torch.nn.Parameter(torch.zeros(2))}
    assert layout_key(plain, 1, False) is not None
    assert layout_key({**plain, "t": torch.zeros(2).as_subclass(Tagged)}, 1, False) is None


def test_an_encrypted_save_takes_the_direct_path_and_restores(tmp_path: Path) -> None:
    keystore = tmp_path / "keys"
    state = mixed_state()
    generation = saved(tmp_path / "s", state, direct=True, keystore=keystore)
    assert all(name.endswith(".enc") for name in tensor_files(generation))
    back = mixed_state(seed=2)
    with cv.CheckpointManager(tmp_path / "s", run_id="r", keystore=keystore) as mgr:
        assert mgr.restore(back).step == 1
    assert all(torch.equal(back["model"][k], v) for k, v in state["model"].items())  # type: ignore[index,attr-defined]
