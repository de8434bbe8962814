"""The restore of many small tensors: every tensor stored whole is read straight into
its buffer without DCP's planner (``ckptvault.io.whole_read``), bit for bit, every
byte still checked against its chunk digest; any other layout still goes through
DCP; and the manifest is parsed once per restore. Costs are asserted as counts
(parses, planner calls), never as times (``bench/`` times them)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptvault as cv
from ckptvault.errors import FormatError, IntegrityError, NoValidCheckpoint
from ckptvault.format import canonical
from ckptvault.format.layout import MANIFEST_NAME
from ckptvault.format.manifest import parse_manifest
from ckptvault.io.dcp_io import read_tensors
from ckptvault.storage import open_store
from ckptvault.trust.checks import check_structure
from support.common import TinyNet, writable
from support.forging import read_logical, write_logical

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.float8_e4m3fn,
]


def mixed_tensors(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``count`` small tensors cycling through dtypes and shapes: 0-dim, empty (one
    and two dimensions), 1-D of odd lengths, 2-D; random bits, so that every byte
    pattern (NaN payloads and signed zeros included) must come back as it was."""
    generator = torch.Generator().manual_seed(seed)
    shapes: list[tuple[int, ...]] = [(), (0,), (3, 0), (1,), (7,), (5, 3), (64,), (2, 2, 3)]
    tensors = {}
    for index in range(count):
        dtype = DTYPES[index % len(DTYPES)]
        shape = shapes[index % len(shapes)]
        nbytes = max(1, torch.Size(shape).numel()) * dtype.itemsize
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
        value = raw[: torch.Size(shape).numel() * dtype.itemsize].view(dtype).reshape(shape)
        tensors[f"layer{index}.{dtype}".replace("torch.", "")] = value.clone()
    return tensors


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert bits(got[key]) == bits(value), key


class DcpLoads:
    """Counts calls of ``torch.distributed.checkpoint.load`` (the planner's path)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = dcp.load

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(dcp, "load", counting)


class ManifestParses:
    """Counts JSON parses of manifest bytes, wherever they happen: every canonical
    parse goes through ``canonical.loads_bounded`` naming the document it reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = canonical.loads_bounded

        def counting(data: Any, what: str, **kwargs: Any) -> Any:
            if what.endswith(MANIFEST_NAME):
                self.calls += 1
            return original(data, what, **kwargs)

        monkeypatch.setattr(canonical, "loads_bounded", counting)


# -- the planner-free path --------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [4096, 16384, 1 << 22])
def test_many_small_tensors_of_mixed_dtypes_come_back_bit_exact(store, monkeypatch, chunk_size):
    """Small chunks cut tensors at their boundaries; large ones hold hundreds of
    tensors each (more than one ``preadv`` takes)."""
    tensors = mixed_tensors(1200)
    loads = DcpLoads(monkeypatch)
    with cv.CheckpointManager(store, run_id="r", chunk_size=chunk_size) as mgr:
        mgr.save(1, {"weights": tensors})
        into_live = {"weights": {k: torch.zeros_like(v) for k, v in tensors.items()}}
        live_objects = dict(into_live["weights"])
        info = mgr.restore(into_live)
        assert info is not None and len(info.loaded) == len(tensors)
        assert_bit_exact(into_live["weights"], tensors)
        # Copied into the caller's own tensors, not swapped for new ones.
        assert all(into_live["weights"][k] is live_objects[k] for k in tensors)
        into_empty: dict[str, Any] = {"weights": {}}
        mgr.restore(into_empty)
        assert_bit_exact(into_empty["weights"], tensors)
    assert loads.calls == 0  # no DCP planning for a layout it has nothing to decide in


def test_a_model_and_its_optimizer_restore_through_the_fast_path(store, monkeypatch):
    torch.manual_seed(0)
    model = TinyNet()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    moments = [s["exp_avg"].clone() for s in optimizer.state.values()]
    loads = DcpLoads(monkeypatch)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"model": model, "optimizer": optimizer})
        fresh = TinyNet()
        fresh_optimizer = torch.optim.Adam(fresh.parameters())
        mgr.restore({"model": fresh, "optimizer": fresh_optimizer})
    assert_bit_exact(fresh.state_dict(), saved)
    got = [s["exp_avg"] for s in fresh_optimizer.state.values()]
    assert all(bits(a) == bits(b) for a, b in zip(got, moments, strict=True))
    assert loads.calls == 0


def test_a_generation_without_tensors_still_verifies_its_files(store):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"meta": {"tokens": 5}})
        state: dict[str, Any] = {"meta": {"tokens": 0}}
        assert mgr.restore(state) is not None and state["meta"] == {"tokens": 5}


# -- every byte verified ----------------------------------------------------------------


def flip_tensor_byte(generation: Path, fqn: str, offset: int = 0) -> None:
    """Flip one bit of tensor ``fqn``'s stored bytes (found through its manifest:
    format 3, the index holding its chunk)."""
    (chunk,) = read_logical(generation)["dcp"]["tensors"][fqn]["chunks"]
    path = writable(generation / chunk["file"])
    data = bytearray(path.read_bytes())
    data[chunk["start"] + offset] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("chunk_size", [4096, 16384])
def test_a_flipped_byte_in_a_small_tensor_is_refused(store, chunk_size):
    """Read with one ``preadv`` into the tensors (4 KiB chunks: ~90 tensors each) and
    through a bounce buffer (16 KiB: more than a ``preadv`` takes); either way the
    chunk is refused before any of it is used. The tensor lies past the chunks that
    hold the file's header, which the structure checks verify themselves."""
    tensors = mixed_tensors(1200, seed=1)
    victim = "layer1015.int8"  # 12 bytes, about 45 KB into the file
    assert tensors[victim].shape == (2, 2, 3)
    with cv.CheckpointManager(store, run_id="r", chunk_size=chunk_size) as mgr:
        mgr.save(1, {"weights": tensors})
        newer = Path(mgr.save(2, {"weights": tensors}).result().path)
    flip_tensor_byte(newer, f"weights/{victim}", offset=3)
    opened = open_store(store, must_exist=True)
    ref = next(r for r in opened.list_generations() if r.step == 2)
    checked = check_structure(opened, ref)  # the structure is fine; the bytes are not
    with pytest.raises(IntegrityError, match="do not match the manifest digest"):
        read_tensors(opened, ref, checked.manifest, threads=2)
    # Restore skips it for the older generation, and says why.
    live = {"weights": {k: torch.zeros_like(v) for k, v in tensors.items()}}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(live)
        assert info is not None and info.step == 1
        assert "digest-mismatch" in info.skipped[0].reason
        assert_bit_exact(live["weights"], tensors)
        # Asked for step 2 alone: refused, and the live state is left as it was.
        untouched = {"weights": {k: torch.zeros_like(v) for k, v in tensors.items()}}
        with pytest.raises(NoValidCheckpoint, match="digest-mismatch"):
            mgr.restore(untouched, step=2)
    assert all(not bits(v).strip(b"\x00") for v in untouched["weights"].values())


# -- other layouts: DCP's planner -------------------------------------------------------


def split_into_columns(generation: Path) -> None:
    """Rewrite a generation of ``left`` (6x3) and ``right`` (6x1) into the layout a
    sharded save writes: one tensor ``w`` (6x4) stored as two column chunks (the
    files are unchanged; the manifest, root and index, is rewritten with every
    digest recomputed: :func:`forging.write_logical`)."""
    document = read_logical(generation)
    left, right = (document["dcp"]["tensors"][k]["chunks"][0] for k in ("left", "right"))
    document["dcp"]["tensors"] = {
        "w": {
            "dtype": "float32",
            "shape": [6, 4],
            "chunks": [{**left, "offsets": [0, 0]}, {**right, "offsets": [0, 3]}],
        }
    }
    document["state"] = {"w": {"$tensor": "w"}}
    write_logical(generation, document)


def test_a_layout_split_into_chunks_goes_through_dcp_and_restores(store, monkeypatch):
    full = torch.randn(6, 4)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        generation = Path(
            mgr.save(1, {"left": full[:, :3].contiguous(), "right": full[:, 3:].contiguous()})
            .result()
            .path
        )
    split_into_columns(generation)
    loads = DcpLoads(monkeypatch)
    live = {"w": torch.zeros(6, 4)}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(live)
    assert info is not None and info.step == 1
    assert torch.equal(live["w"], full)
    assert loads.calls == 1  # the chunks had to be mapped onto the tensor: DCP did it


# -- the manifest, parsed once ----------------------------------------------------------


@pytest.mark.parametrize("encrypted", [False, True], ids=["plain", "encrypted"])
def test_the_manifest_is_parsed_once_per_restore(store, tmp_path, monkeypatch, encrypted):
    options = {"keystore": tmp_path / "keys"} if encrypted else {}
    tensors = mixed_tensors(50)
    with cv.CheckpointManager(store, run_id="r", **options) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"weights": tensors})
    parses = ManifestParses(monkeypatch)
    with cv.CheckpointManager(store, run_id="r", **options) as mgr:
        live: dict[str, Any] = {"weights": {}}
        info = mgr.restore(live)
    assert info is not None and info.step == 3
    assert_bit_exact(live["weights"], tensors)
    assert parses.calls == 1


def test_a_manifest_holding_a_key_twice_is_refused_by_name(store):
    """The quick parse lets a repeated key through to the canonical check, which
    fails on it; the message still names the key, as the careful parse always did."""
    with cv.CheckpointManager(store, run_id="r") as mgr:
        generation = Path(mgr.save(1, {"w": torch.ones(2)}).result().path)
    data = (generation / MANIFEST_NAME).read_bytes()
    doubled = data.replace(b'{"chunk_size":', b'{"chunk_size":1,"chunk_size":', 1)
    assert doubled != data
    with pytest.raises(FormatError, match="holds the key 'chunk_size' twice"):
        parse_manifest(doubled, "test")
    with pytest.raises(FormatError, match="not in canonical form"):
        parse_manifest(data.replace(b'"step":1', b'"step": 1'), "test")


# -- the cyclic collector ---------------------------------------------------------------


def test_a_restore_sets_off_no_collection_and_leaves_the_collector_as_it_was(store):
    """Full collections walk the caller's whole heap and free nothing a restore made;
    it pauses the collector, and gives it back as it found it, raising or not."""
    tensors = mixed_tensors(3000)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"weights": tensors})
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        with cv.CheckpointManager(store, run_id="r") as mgr:
            collections.clear()
            mgr.restore({"weights": {}})
            # At most the one collection the restore's allocations leave due when the
            # collector resumes (unpaused: dozens, full ones among them). Which
            # generation that one is depends on the counts the process had before: in a
            # long test session it may be a full one.
            assert len(collections) <= 1 and gc.isenabled()
            with pytest.raises(NoValidCheckpoint):
                mgr.restore({"weights": {}}, step=7)
            assert gc.isenabled()
            gc.disable()  # the caller's choice stays the caller's
            try:
                mgr.restore({"weights": {}})
                assert not gc.isenabled()
            finally:
                gc.enable()
    finally:
        gc.callbacks.remove(count)
