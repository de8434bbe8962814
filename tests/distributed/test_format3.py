"""Format version 3: a small root manifest over per-rank indexes.

What a user relies on: generations written by the previous format still verify and
restore bit-exactly (real bytes of the format-2 writer, in tests/fixtures/format2);
the root holds no chunk digest and no per-chunk metadata, its files' digests check
with the blake3 package alone as docs/format.md shows; a rank of many reads the root and
only the indexes of the shards it restores; and the root's signature covers every
index, so an index swapped, edited or dropped is refused.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from blake3 import blake3
from safetensors.torch import load_file

import ckptvault as cv
from ckptvault.format.layout import file_holder, index_file_name
from ckptvault.format.manifest import parse_manifest
from ckptvault.format.tensor_table import build_tensor_table
from ckptvault.saving.generation_writer import GenerationWriter
from ckptvault.trust.signing import generate_keypair
from support.common import make_training_state, model_snapshot, run_cli, writable
from support.forging import read_logical, write_logical
from support.multirank import launch

FIXTURES = Path(__file__).resolve().parents[1] / "support" / "fixtures" / "format2"


def ok(codes, reports):
    assert codes == [0] * len(codes), [r.get("log", "")[-2000:] for r in reports]
    return reports


def copy_fixture(kind: str, tmp_path: Path) -> Path:
    """A writable copy of one fixture store (and of its key store: the key store
    insists on private permissions, which git does not keep)."""
    target = tmp_path / kind
    shutil.copytree(FIXTURES / kind, target)
    keys = tmp_path / "keys"
    if not keys.exists():
        shutil.copytree(FIXTURES / "keys", keys)
        keys.chmod(0o700)
        for key in keys.iterdir():
            key.chmod(0o600)
    return target


def fresh_state() -> dict:
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return {
        "model": model,
        "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-3),
        "rng": cv.RNGState(),
        "meta": {"tokens_seen": 0, "name": ""},
    }


OPTIONS = {
    "plain": lambda tmp: {},
    "signed": lambda tmp: {"trusted_keys": [FIXTURES / "signer.pub"], "ledger": tmp / "l1"},
    "encrypted": lambda tmp: {"keystore": tmp / "keys", "ledger": tmp / "l2"},
}


@pytest.mark.parametrize("kind", ["plain", "signed", "encrypted"])
def test_format_2_generations_of_the_old_writer_restore_bit_exactly(tmp_path: Path, kind: str):
    """Real generations the format-2 writer made (plain, signed, signed and encrypted)
    restore into a live state bit for bit, by newest and by step, and verify."""
    store = copy_fixture(kind, tmp_path)
    assert {
        json.loads(m.read_bytes())["format_version"] for m in store.glob("*/manifest.json")
    } == {2}
    expected = load_file(str(FIXTURES / f"{kind}-step20-model.safetensors"))
    state = fresh_state()
    with cv.CheckpointManager(store, run_id=f"fixture-{kind}", **OPTIONS[kind](tmp_path)) as mgr:
        info = mgr.restore(state)
        assert info is not None and info.step == 20 and info.skipped == []
        assert model_snapshot(state["model"]).keys() == expected.keys()
        for key, value in model_snapshot(state["model"]).items():
            assert torch.equal(value, expected[key]), key
        assert state["meta"] == {"tokens_seen": 1020, "name": "fixture"}
        assert state["optimizer"].state  # the moments came back too
        assert mgr.restore(fresh_state(), step=10, allow_rollback_to=10).step == 10
    assert run_cli("verify", str(store), "--all").returncode == 0  # needs no key


def test_a_store_of_both_formats_keeps_saving_and_restoring(tmp_path: Path):
    """A run that resumes from format-2 generations writes format 3 beside them; the
    old ones stay restorable by step, and a flipped byte in an old one is caught."""
    store = copy_fixture("plain", tmp_path)
    state = fresh_state()
    with cv.CheckpointManager(store, run_id="fixture-plain") as mgr:
        assert mgr.restore(state).step == 20
        mgr.save(30, state)
    newest = sorted(store.glob("step-*"))[-1]
    assert json.loads((newest / "manifest.json").read_bytes())["format_version"] == 3
    with cv.CheckpointManager(store, run_id="fixture-plain") as mgr:
        assert mgr.restore(fresh_state()).step == 30
        assert mgr.restore(fresh_state(), step=20).step == 20
    old = sorted(store.glob("step-000000000010*"))[0]
    tensor_file = next(old.glob("*.safetensors"))
    data = bytearray(tensor_file.read_bytes())
    data[-3] ^= 0x40
    writable(tensor_file).write_bytes(bytes(data))
    assert run_cli("verify", str(store), "--step", "10").returncode != 0
    assert run_cli("verify", str(store), "--step", "30").returncode == 0


def test_the_root_holds_no_chunk_and_the_readme_check_works(store: Path):
    """The root lists files with a size and digest only and one index per rank; the
    chunk digests in the index derive the root's file digest, as docs/format.md's
    snippet checks with blake3 alone."""
    with cv.CheckpointManager(store, run_id="r") as mgr:
        path = Path(mgr.save(1, make_training_state()).result().path)
    root = json.loads((path / "manifest.json").read_bytes())
    assert root["format_version"] == 3 and "dcp" not in root
    assert all(set(record) == {"size", "blake3"} for record in root["files"].values())
    assert set(root["indexes"]) == {"r00000-index.json"}
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [*root["files"], *root["indexes"], "manifest.json"]
    )
    generation = str(path)
    for name in root["files"]:  # docs/format.md's snippet, as written there
        index = json.load(open(f"{generation}/{name.split('-')[0]}-index.json"))  # noqa: SIM115
        data, size = open(f"{generation}/{name}", "rb").read(), root["chunk_size"]  # noqa: SIM115
        chunks = [blake3(data[i : i + size]).hexdigest() for i in range(0, len(data), size)]
        whole = blake3(b"ckptvault file digest v2\0" + len(data).to_bytes(8, "little"))
        whole.update(b"".join(bytes.fromhex(d) for d in chunks))
        assert chunks == index["files"][name]
        assert whole.hexdigest() == root["files"][name]["blake3"]


def test_older_formats_are_still_written_on_request_and_read(store: Path, monkeypatch):
    """The writer's format is one attribute (tests write format 2 with it, to keep
    testing how old generations are read): a format-2 generation has no index."""
    monkeypatch.setattr(GenerationWriter, "format_version", 2)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        path = Path(mgr.save(1, {"w": torch.arange(6.0)}).result().path)
    assert not list(path.glob("*-index.json"))
    manifest = json.loads((path / "manifest.json").read_bytes())
    assert manifest["format_version"] == 2 and "dcp" in manifest
    restored = {"w": torch.zeros(6)}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert mgr.restore(restored).step == 1
    assert torch.equal(restored["w"], torch.arange(6.0))


def _signed(tmp_path: Path) -> tuple[Path, dict]:
    private, public = tmp_path / "k.pem", tmp_path / "k.pub"
    generate_keypair(private, public)
    store = tmp_path / "store"
    options = {"signing_key": private, "trusted_keys": [public], "ledger": tmp_path / "ledger"}
    with cv.CheckpointManager(store, run_id="r", **options) as mgr:
        mgr.save(1, make_training_state(seed=1))
        mgr.save(2, make_training_state(seed=2))
    return store, options


def _restore_skips(store: Path, options: dict) -> tuple[int, list[str]]:
    with cv.CheckpointManager(store, run_id="r", **options) as mgr:
        info = mgr.restore(make_training_state())
    return info.step, [s.reason for s in info.skipped]


@pytest.mark.parametrize(
    "tamper",
    ["flip a byte", "another generation's index", "drop it", "an extra index"],
)
def test_the_signed_root_covers_every_index(tmp_path: Path, tamper: str):
    """With signatures required, anything done to an index (edited, swapped for the
    older generation's, removed, or one added) makes the generation refused alone,
    and the restore falls back to the one before."""
    store, options = _signed(tmp_path)
    old, new = sorted(store.glob("step-*"))
    index = new / "r00000-index.json"
    if tamper == "flip a byte":
        data = bytearray(index.read_bytes())
        data[len(data) // 2] ^= 0x01
        writable(index).write_bytes(bytes(data))
    elif tamper == "another generation's index":
        writable(index).write_bytes((old / "r00000-index.json").read_bytes())
    elif tamper == "drop it":
        writable(index).unlink()
    else:
        (new / "r00001-index.json").write_bytes(index.read_bytes())
    step, reasons = _restore_skips(store, options)
    expected = {
        "flip a byte": "digest-mismatch",
        "another generation's index": "digest-mismatch",
        "drop it": "file-missing",
        "an extra index": "file-extra",
    }[tamper]
    assert step == 1 and len(reasons) == 1 and expected in reasons[0], reasons
    report = json.loads(run_cli("verify", str(store), "--all", "--json").stdout)
    codes = {r["step"]: {p["code"] for p in r["problems"]} for r in report}
    assert codes == {1: set(), 2: {expected}}, codes


def _forge(generation: Path, change) -> None:
    document = read_logical(generation)
    change(document)
    write_logical(generation, document)


def test_an_unsigned_store_refuses_indexes_that_disagree_with_their_root(tmp_path: Path):
    """Without signatures anyone who writes the store can rewrite root and indexes
    together; what does not add up is still refused: an index whose chunk digests do
    not derive the root's file digest, whose chunks are not the cells the root gives
    it, or that names another generation."""
    store = tmp_path / "store"
    with cv.CheckpointManager(store, run_id="r") as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, make_training_state(seed=step))
    one, two, three, four = sorted(store.glob("step-*"))

    # 2: the index's chunk digests no longer derive the root's digest of the file.
    index = json.loads((two / "r00000-index.json").read_bytes())
    name = next(iter(index["files"]))
    index["files"][name][0] = "0" * 64
    _rewrite_index(two, index)
    # 3: a chunk moved to another offset than the table's cell (the table kept).
    root = json.loads((three / "manifest.json").read_bytes())
    index = json.loads((three / "r00000-index.json").read_bytes())
    fqn = next(f for f, chunks in index["tensors"].items() if chunks[0][1] and chunks[0][1][0] > 1)
    index["tensors"][fqn][0][1][0] -= 1  # sizes: one row short
    _rewrite_index(three, index, root)
    # 4: the index claims another generation.
    index = json.loads((four / "r00000-index.json").read_bytes())
    index["generation_id"] = one.name.split(".", 1)[1]
    _rewrite_index(four, index)

    report = json.loads(run_cli("verify", str(store), "--all", "--json").stdout)
    codes = {r["step"]: {p["code"] for p in r["problems"]} for r in report}
    assert codes == {
        1: set(),
        2: {"digest-mismatch"},
        3: {"manifest-inconsistent"},
        4: {"manifest-invalid"},
    }, codes
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(make_training_state())
    assert info.step == 1 and len(info.skipped) == 3


def _rewrite_index(generation: Path, index: dict, root: dict | None = None) -> None:
    """Write ``index`` as rank 0's index with the root's record of it updated (and the
    root's self-digest): what an attacker without a signing key can do."""
    from ckptvault.format.canonical import dumps_canonical

    data = dumps_canonical(index)
    writable(generation / "r00000-index.json").write_bytes(data)
    root = root or json.loads((generation / "manifest.json").read_bytes())
    root.pop("manifest_blake3")
    root["indexes"]["r00000-index.json"] = {"size": len(data), "blake3": blake3(data).hexdigest()}
    root["manifest_blake3"] = blake3(dumps_canonical(root)).hexdigest()
    writable(generation / "manifest.json").write_bytes(dumps_canonical(root))


def test_the_forging_tool_round_trips_a_generation_exactly(store: Path):
    """Tests edit the logical manifest through tests/forging.py; unchanged, it writes
    back the very bytes ckptvault wrote (root and index), so its edits are the only
    difference an attack makes."""
    with cv.CheckpointManager(store, run_id="r") as mgr:
        path = Path(mgr.save(1, make_training_state()).result().path)
    before = {p.name: p.read_bytes() for p in path.glob("*.json")}
    _forge(path, lambda document: None)
    assert {p.name: p.read_bytes() for p in path.glob("*.json")} == before


def test_the_tensor_table_is_a_grid_for_shards_and_a_list_otherwise():
    """Shards along one dimension, however many, are two run-length pairs; a layout
    that is no grid is listed chunk by chunk; each cell's holder is its file's rank."""

    def chunk(offsets, sizes, rank):
        return {"offsets": offsets, "sizes": sizes, "file": f"r{rank:05d}-000.safetensors"}

    rows = [chunk([4 * r, 0], [4, 8], r) for r in range(1024)]
    rows[-1] = chunk([4 * 1023, 0], [3, 8], 1023)  # an uneven last shard
    empty = chunk([4095, 0], [0, 8], 5)  # an empty shard holds no cell
    irregular = [chunk([0, 0], [2, 2], 0), chunk([0, 2], [4, 2], 1), chunk([2, 0], [2, 2], 2)]
    table = build_tensor_table(
        {
            "w": {"dtype": "float32", "shape": [4095, 8], "chunks": [*rows, empty]},
            "odd": {"dtype": "float32", "shape": [4, 4], "chunks": irregular},
        },
        lambda name: file_holder(name) or 0,
    ).to_json()
    assert table["w"] == {
        "dtype": "float32",
        "shape": [4095, 8],
        "split": [[0, [[4, 1023], [3, 1]]]],
        "holders": [[0, 1024]],
    }
    assert table["odd"]["chunks"] == [[[0, 0], [2, 2], 0], [[0, 2], [4, 2], 1], [[2, 0], [2, 2], 2]]
    assert index_file_name(7) == "r00007-index.json" and file_holder("r000007-x") is None


def _rows(extent: int, ranks: int, rank: int) -> tuple[int, int]:
    """``rank``'s rows of ``extent`` under FSDP2's Shard(0) (torch.chunk)."""
    step = -(-extent // ranks)
    low = min(rank * step, extent)
    return low, min(low + step, extent)


def _indexes_needed(generation: Path, ranks: int, rank: int) -> set[str]:
    """Worked out from every chunk, naively: the indexes holding a chunk that
    overlaps rank ``rank``'s shard (dim 0) of a tensor, or any chunk of a 0-d one."""
    needed = set()
    for info in read_logical(generation)["dcp"]["tensors"].values():
        for chunk in info["chunks"]:
            if not all(chunk["sizes"]):
                continue
            if info["shape"]:
                low, high = _rows(info["shape"][0], ranks, rank)
                start, end = chunk["offsets"][0], chunk["offsets"][0] + chunk["sizes"][0]
                if not (start < high and low < end):
                    continue
            needed.add(index_file_name(file_holder(chunk["file"]) or 0))
    return needed


@pytest.mark.parametrize(("saved_on", "restored_on"), [(3, 3), (2, 4)])
def test_a_rank_reads_the_root_and_only_the_indexes_of_its_shards(
    tmp_path: Path, saved_on: int, restored_on: int
):
    """FSDP2 saved on N ranks: each restoring rank opens the root and exactly the
    indexes holding chunks that overlap its own shards (worked out here from every
    chunk): on the same ranks, its own index (and the one holding the replicated
    step counters), never every index."""
    store = tmp_path / "store"
    ok(*launch("fsdp_save", store, saved_on, tmp_path / "save"))
    restored = ok(*launch("fsdp_restore_recording_reads", store, restored_on, tmp_path / "load"))
    newest = sorted(store.glob("step-*"))[-1]
    root = parse_manifest((newest / "manifest.json").read_bytes(), "test")
    assert len(root.indexes or {}) == saved_on
    for report in restored:
        rank = report["rank"]
        opened = {name for name in report["opened"] if name.endswith("-index.json")}
        assert "manifest.json" in report["opened"]
        assert opened == _indexes_needed(newest, restored_on, rank), report["opened"]
        if saved_on == restored_on:
            assert index_file_name(rank) in opened
    if saved_on == restored_on:
        assert any(
            len(r["opened"]) and sum(n.endswith("-index.json") for n in r["opened"]) < saved_on
            for r in restored
        )
