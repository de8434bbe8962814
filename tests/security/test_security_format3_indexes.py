"""Format 3's indexes under attack, and loaded in part: what binds them to the root.

A rank of many loads the root and only the indexes holding the cells it restores.
That must never let it read a file whose index it did not load, and the indexes it
loads must cover every element of its boxes exactly once (a real two-rank FSDP
save, every box of every tensor). Beside that: an index swapped for a FIFO or a
link, grown, or recorded huge; an encrypted root's MAC covering the indexes; a copy
into another tier that verifies the indexes it copies, also when one changes
mid-copy; and the writer committing (fsync'd) every index before the root.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import ckptvault as cv
from ckptvault.errors import CheckpointError, IntegrityError
from ckptvault.format.manifest import parse_manifest
from ckptvault.io.verified_ranges import VerifiedRanges
from ckptvault.replication.replicator import copy_generation
from ckptvault.storage.posix.files import PosixWritableFile
from ckptvault.storage.posix.publish import AtomicRename
from ckptvault.storage.posix.store import PosixStore
from ckptvault.trust.checks import check_structure
from ckptvault.trust.indexes import indexes_for_regions
from ckptvault.trust.problems import GenerationRejected
from support.common import make_training_state, run_cli, writable
from support.format3_plants import read_root, restore_skipping, write_index, write_root
from support.multirank import launch


@pytest.fixture(scope="module")
def fsdp_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One generation saved by two ranks with FSDP2 (each parameter and its optimizer
    state sharded by rows, step counters replicated): two indexes."""
    base = tmp_path_factory.mktemp("fsdp")
    codes, reports = launch("fsdp_save", base / "store", 2, base / "save")
    assert codes == [0, 0], [r.get("log", "")[-2000:] for r in reports]
    return base / "store"


def _copy_of(store: Path, tmp_path: Path) -> tuple[PosixStore, Path]:
    target = tmp_path / "store"
    shutil.copytree(store, target)
    return PosixStore(target), next(target.glob("step-*"))


def _ref(store: PosixStore):
    (ref,) = store.list_generations()
    return ref


def test_a_rank_that_loaded_one_index_reads_no_file_of_another(fsdp_store: Path):
    """Loaded with rank 0's index only, the manifest knows rank 1's file by size and
    digest but not its chunk digests: reading it fails its digest check before a
    byte is used, and no chunk of rank 1's file is in the metadata a reader plans by."""
    store = PosixStore(fsdp_store)
    ref = _ref(store)
    checked = check_structure(store, ref, None, lambda root: {"r00000-index.json"})
    manifest = checked.manifest
    assert manifest.pending_indexes == {"r00001-index.json"}
    assert manifest.covers("r00000-000.safetensors")
    assert not manifest.covers("r00001-000.safetensors")
    files = {c["file"] for info in manifest.dcp["tensors"].values() for c in info["chunks"]}
    assert files == {"r00000-000.safetensors"}
    ranges = VerifiedRanges(store, ref, manifest, {})
    ranges.read_range("r00000-000.safetensors", 0, memoryview(bytearray(64)))
    with pytest.raises(CheckpointError):
        ranges.read_range("r00001-000.safetensors", 0, memoryview(bytearray(64)))


def _rows(extent: int, ranks: int, rank: int) -> tuple[int, int]:
    step = -(-extent // ranks)
    low = min(rank * step, extent)
    return low, min(low + step, extent)


def _boxes(shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Whole, each rank's rows for 1-4 ranks, single elements, a column."""
    if not shape:
        return [((), ())]
    boxes = [((0,) * len(shape), shape)]
    for ranks in (1, 2, 3, 4):
        for rank in range(ranks):
            low, high = _rows(shape[0], ranks, rank)
            if high > low:
                boxes.append(((low, *[0] * (len(shape) - 1)), (high - low, *shape[1:])))
    for corner in ((0,) * len(shape), tuple(d - 1 for d in shape), tuple(d // 2 for d in shape)):
        boxes.append((corner, (1,) * len(shape)))
    if len(shape) == 2:
        boxes.append(((0, shape[1] - 1), (shape[0], 1)))
    return boxes


def test_the_indexes_a_box_needs_cover_it_exactly_once(fsdp_store: Path):
    """For every tensor and box, the indexes the table names for it, loaded alone,
    give chunks covering each element of the box exactly once (never a hole a
    restore would leave unfilled), and each of them holds a piece of the box."""
    store = PosixStore(fsdp_store)
    ref = _ref(store)
    root = check_structure(store, ref, None, lambda root: ()).manifest
    assert root.tensor_table is not None
    loaded: dict[frozenset[str], dict] = {}
    for fqn, layout in root.tensor_table.tensors.items():
        for offsets, sizes in _boxes(layout.shape):
            wanted = frozenset(indexes_for_regions(root, {fqn: [(offsets, sizes)]}))
            if wanted not in loaded:
                checked = check_structure(store, ref, None, lambda root, w=wanted: w)
                loaded[wanted] = checked.manifest.dcp["tensors"]
            counts = np.zeros(sizes, dtype=np.int64)
            holders = set()
            for chunk in loaded[wanted][fqn]["chunks"]:
                low = [max(o, b) for o, b in zip(chunk["offsets"], offsets, strict=True)]
                high = [
                    min(o + s, b + t)
                    for o, s, b, t in zip(
                        chunk["offsets"], chunk["sizes"], offsets, sizes, strict=True
                    )
                ]
                if all(h > lo for h, lo in zip(high, low, strict=True)):
                    region = tuple(
                        slice(lo - b, h - b) for lo, h, b in zip(low, high, offsets, strict=True)
                    )
                    counts[region] += 1
                    holders.add(f"{chunk['file'][:6]}-index.json")
            assert (counts == 1).all(), (fqn, offsets, sizes, counts)
            assert holders == wanted, (fqn, offsets, sizes, holders, wanted)


@pytest.fixture
def two_steps(store: Path) -> tuple[Path, Path]:
    with cv.CheckpointManager(store, run_id="r") as mgr:
        one = Path(mgr.save(1, make_training_state(seed=1)).result().path)
        two = Path(mgr.save(2, make_training_state(seed=2)).result().path)
    return one, two


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tamper", ["fifo", "symlink", "hard link", "grown", "recorded huge"])
def test_an_index_swapped_linked_grown_or_recorded_huge_is_refused(two_steps, tamper):
    """Nothing blocks on a FIFO, follows a link to another generation's index, reads
    past what the root records, or reads an index the root records past 64 MiB."""
    one, two = two_steps
    index = two / "r00000-index.json"
    if tamper == "fifo":
        writable(index).unlink()
        os.mkfifo(index)
    elif tamper == "symlink":
        writable(index).unlink()
        index.symlink_to(one / "r00000-index.json")
    elif tamper == "hard link":  # to a file outside the store, holding the same bytes
        outside = two.parent.parent / "outside.json"
        outside.write_bytes(index.read_bytes())
        writable(index).unlink()
        os.link(outside, index)
    elif tamper == "grown":
        writable(index).write_bytes(index.read_bytes() + b" " * 4096)
    else:
        root = read_root(two)
        root["indexes"]["r00000-index.json"]["size"] = (64 << 20) + 1
        write_root(two, root)
    code = {"grown": "size-mismatch", "recorded huge": "manifest-invalid"}.get(tamper)
    restore_skipping(two.parent, code or "unsafe-entry")


def test_the_mac_of_an_encrypted_root_covers_its_indexes(store: Path, tmp_path: Path):
    """Without the run's key, swap two same-shaped tensors' chunk records inside an
    index and record the new index in the root: every digest agrees, the tensor
    files are untouched, so only the MAC (over the root, which holds the index's
    digest) can tell, and it does, before a tensor byte is read."""
    options = {"keystore": tmp_path / "keys", "ledger": tmp_path / "ledger"}
    with cv.CheckpointManager(store, run_id="r", **options) as mgr:
        mgr.save(1, make_training_state(seed=1))
        two = Path(mgr.save(2, make_training_state(seed=2)).result().path)
    root = read_root(two)
    index = json.loads((two / "r00000-index.json").read_bytes())
    tensors = index["tensors"]
    tensors["model/fc1.bias"], tensors["model/norm.bias"] = (
        tensors["model/norm.bias"],
        tensors["model/fc1.bias"],
    )
    write_index(two, root, index)
    write_root(two, root)
    with cv.CheckpointManager(store, run_id="r", **options) as mgr:
        info = mgr.restore(make_training_state(seed=9))
    assert info.step == 1 and [s.reason.split(":")[0] for s in info.skipped] == [
        "manifest-unauthenticated"
    ], info.skipped


def test_a_copy_to_another_tier_has_the_exact_indexes_and_refuses_tampered_ones(
    fsdp_store: Path, tmp_path: Path
):
    """The copy publishes the root's exact bytes over byte-identical indexes; an index
    edited in the source, or changed between the check and the copy, is refused and
    nothing is published in the target."""
    source = PosixStore(fsdp_store)
    (tmp_path / "tier").mkdir()
    (tmp_path / "tier2").mkdir()
    target = PosixStore(tmp_path / "tier")
    copied = copy_generation(source, _ref(source), target)
    original = next(fsdp_store.glob("step-*"))
    for name in ("manifest.json", "r00000-index.json", "r00001-index.json"):
        assert (Path(copied.location) / name).read_bytes() == (original / name).read_bytes()
    assert run_cli("verify", str(tmp_path / "tier"), "--all").returncode == 0

    tampered, generation = _copy_of(fsdp_store, tmp_path / "a")
    data = bytearray((generation / "r00001-index.json").read_bytes())
    data[len(data) // 2] ^= 0x01
    writable(generation / "r00001-index.json").write_bytes(bytes(data))
    empty = PosixStore(tmp_path / "tier2")
    with pytest.raises(GenerationRejected, match="digest"):
        copy_generation(tampered, _ref(tampered), empty)
    assert empty.list_generations() == []

    racing, generation = _copy_of(fsdp_store, tmp_path / "b")
    reads = {"n": 0}
    read_bytes = racing.read_bytes

    def changing(ref, name, limit):
        data = read_bytes(ref, name, limit)
        if name == "r00001-index.json":
            reads["n"] += 1
            if reads["n"] > 1:  # checked once, then swapped under the copy
                return data[:-1] + b" "
        return data

    racing.read_bytes = changing  # type: ignore[method-assign]
    with pytest.raises(IntegrityError, match="changed while it was being copied"):
        copy_generation(racing, _ref(racing), empty)
    assert empty.list_generations() == [] and reads["n"] == 2


def test_the_writer_commits_every_index_before_the_root(store: Path, monkeypatch):
    """Each index is committed (made read-only and fsync'd) in staging before the
    root is written; a publish that fails leaves no generation, and the next save and
    restore go on as if it never happened."""
    events: list[str] = []
    commit, publish = PosixWritableFile.commit, AtomicRename.publish

    def recording_commit(self):
        commit(self)
        events.append(os.path.basename(self.where))

    def recording_publish(self, area, step, manifest, signature):
        root = parse_manifest(manifest, "test")
        assert set(root.indexes or {}) <= set(events), events
        events.append("publish")
        return publish(self, area, step, manifest, signature)

    monkeypatch.setattr(PosixWritableFile, "commit", recording_commit)
    monkeypatch.setattr(AtomicRename, "publish", recording_publish)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, make_training_state(seed=1))
    first_publish = events.index("publish")
    assert events.index("r00000-index.json") < first_publish
    assert events.index("manifest.json") > first_publish  # written by the publish rule

    def failing(self, area, step, manifest, signature):
        raise OSError("the disk went away before the root was written")

    monkeypatch.setattr(AtomicRename, "publish", failing)
    with (
        cv.CheckpointManager(store, run_id="r") as mgr,
        pytest.raises((CheckpointError, OSError), match="disk went away"),
    ):
        mgr.save(2, make_training_state(seed=2))
    assert [ref.step for ref in PosixStore(store).list_generations()] == [1]
    monkeypatch.setattr(AtomicRename, "publish", publish)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(3, make_training_state(seed=3))
        assert mgr.restore(make_training_state(seed=9)).step == 3
    assert sorted(ref.step for ref in PosixStore(store).list_generations()) == [1, 3]
    assert not any((store / ".staging").iterdir())


def test_an_unsigned_root_that_redeals_a_rank_s_cells_is_refused(fsdp_store, tmp_path):
    """The root given to rank 1's index the cells of rank 0 (holders reversed) while
    the indexes stay as written: each index then lists cells the table gives the
    other one, and both are refused, whichever a rank loads."""
    store, generation = _copy_of(fsdp_store, tmp_path)
    root = read_root(generation)
    for layout in root["tensors"].values():
        if layout.get("holders") == [[0, 2]]:
            layout["holders"] = [[1, 1], [0, 1]]
    write_root(generation, root)
    ref = _ref(store)
    for wanted in ({"r00000-index.json"}, {"r00001-index.json"}):
        with pytest.raises(GenerationRejected) as rejected:
            check_structure(store, ref, None, lambda root, w=wanted: w)
        assert rejected.value.problems[0].code == "manifest-inconsistent"
