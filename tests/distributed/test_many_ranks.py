"""Collective saves and resharding restores with real process groups (gloo on
127.0.0.1, one OS process per rank; see ``rank_worker.py`` for the state)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from support.common import run_cli
from support.forging import read_logical
from support.multirank import launch


def ok(codes: list[int], reports: list[dict]) -> list[dict]:
    assert codes == [0] * len(codes), [r.get("log", "")[-2000:] for r in reports]
    return reports


def published(store: Path) -> list[int]:
    return sorted(int(p.name[5:17]) for p in store.glob("step-*"))


@pytest.fixture(scope="module")
def two_rank_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Steps 1 and 2 saved by two ranks, and what each rank drew right after."""
    root = tmp_path_factory.mktemp("two_ranks")
    store = root / "store"
    saved = ok(*launch("save", store, 2, root / "save"))
    return store, saved


def test_two_ranks_publish_one_generation_with_every_ranks_files(two_rank_store):
    store, _saved = two_rank_store
    assert published(store) == [1, 2]
    newest = sorted(store.glob("step-*"))[-1]
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["writer"]["world_size"] == 2
    assert sorted(manifest["files"]) == ["r00000-000.safetensors", "r00001-000.safetensors"]
    assert sorted(manifest["indexes"]) == ["r00000-index.json", "r00001-index.json"]
    chunks = read_logical(newest)["dcp"]["tensors"]["model/w"]["chunks"]
    assert [c["offsets"] for c in chunks] == [[0, 0], [5, 0]]  # one shard from each rank
    assert set(manifest["state"]) == {"global", "ranks"} and len(manifest["state"]["ranks"]) == 2
    assert not list((store / ".staging").iterdir())
    assert run_cli("verify", str(store), "--all").returncode == 0


def test_same_world_size_restores_every_rank_bit_exactly_rng_included(two_rank_store, tmp_path):
    store, saved = two_rank_store
    # Fresh interpreters, not forks: each rank's RNG state comes from the checkpoint
    # alone, with nothing inherited from a parent.
    restored = ok(*launch("restore", store, 2, tmp_path, fresh=True))
    for before, after in zip(saved, restored, strict=True):
        assert after["step"] == 2 and after["weight_exact"] and after["after_step_exact"]
        assert after["bias"] == [2.0, 2.0, 2.0] and after["meta"] == {"tokens_seen": 2000}
        assert after["reset"] == []
        assert after["draw"] == before["after_save_draw"]  # each rank's own RNG back
        assert after["local_rows"] == 5


@pytest.mark.parametrize("world", [1, 3])
def test_two_ranks_restore_onto_another_world_size(two_rank_store, tmp_path, world):
    store, saved = two_rank_store
    restored = ok(*launch("restore", store, world, tmp_path))
    rows = [4, 4, 2] if world == 3 else [10]  # DTensor splits 10 rows as torch.chunk does
    for rank, after in enumerate(restored):
        assert after["step"] == 2 and after["weight_exact"] and after["after_step_exact"]
        assert after["meta"] == {"tokens_seen": 2000}  # global: rank 0's, on every rank
        assert after["reset"] == ["rng"]  # per-rank state means nothing on 3 ranks
        assert after["local_rows"] == rows[rank]
        assert after["draw"] not in [before["after_save_draw"] for before in saved]


def test_one_process_checkpoint_restores_onto_two_ranks(tmp_path):
    store = tmp_path / "store"
    ok(*launch("save", store, 1, tmp_path / "save"))
    restored = ok(*launch("restore", store, 2, tmp_path / "restore"))
    for after in restored:
        assert after["step"] == 2 and after["weight_exact"] and after["after_step_exact"]
        assert after["local_rows"] == 5 and after["reset"] == ["rng"]


def test_a_corrupt_shard_on_one_rank_makes_every_rank_fall_back(tmp_path):
    store = tmp_path / "store"
    ok(*launch("save", store, 2, tmp_path / "save"))
    newest = sorted(store.glob("step-*"))[-1] / "r00001-000.safetensors"
    newest.chmod(0o644)
    data = bytearray(newest.read_bytes())
    data[-3] ^= 0xFF  # inside rank 1's shard of the weight
    newest.write_bytes(bytes(data))
    restored = ok(*launch("restore", store, 2, tmp_path / "restore"))
    for after in restored:
        assert after["step"] == 1 and after["weight_exact"]
        ((step, reason),) = after["skipped"]
        assert step == 2 and "digest-mismatch" in reason


def test_a_rank_that_fails_to_write_fails_the_save_on_every_rank(tmp_path):
    store = tmp_path / "store"
    codes, reports = launch("fail_in_write", store, 2, tmp_path / "run")
    ok(codes, reports)
    for report in reports:
        kind, message = report["error"]
        assert kind == "SaveFailedError" and "rank 1" in message
    assert published(store) == [1]
    assert not list((store / ".staging").iterdir())  # the attempt was cleaned up


def test_a_rank_killed_mid_save_publishes_nothing_and_the_survivor_raises(tmp_path):
    store = tmp_path / "store"
    codes, reports = launch("die_in_write", store, 2, tmp_path / "run", timeout=120)
    assert codes[1] == -9 and codes[0] == 0, reports[0].get("log")
    kind, message = reports[0]["error"]
    assert kind in ("CollectiveError", "SaveFailedError"), message
    assert published(store) == [1]
    assert not list((store / ".staging").iterdir())  # rank 0 removed the whole attempt


def remote_store(backend: str, request: pytest.FixtureRequest) -> str:
    """A fresh store URL on the loopback S3 server or on Azurite."""
    if backend == "s3":
        return f"s3://{request.getfixturevalue('s3_bucket')}/job"
    return f"az://{request.getfixturevalue('azure_container')}/job"


@pytest.mark.parametrize("backend", ["posix", "s3", "azure"])
def test_rank_0_killed_after_publishing_leaves_the_generation_whole(backend, tmp_path, request):
    """Rank 0 published step 2 and died before telling rank 1, which raises: rank 1 must
    not remove its files, which are the published generation's now (a regression: it
    removed them, and step 2 was published without rank 1's shard)."""
    store = tmp_path / "store" if backend == "posix" else remote_store(backend, request)
    codes, reports = launch("die_after_publish", store, 2, tmp_path / "run", timeout=120)
    assert codes == [-9, 0], reports[1].get("log")
    assert reports[1]["error"][0] == "CollectiveError", reports[1]["error"]
    verified = run_cli("verify", str(store), "--all", "--json")  # every file, every digest
    assert verified.returncode == 0, verified.stdout
    assert [report["step"] for report in json.loads(verified.stdout)] == [2, 1]


@pytest.mark.heavy
# Azure's run: make test-extended (the conformance suite and the crash harness cover
# az:// in make test; this is a second object store through the same two-rank path).
@pytest.mark.parametrize("backend", ["s3", pytest.param("azure", marks=pytest.mark.extended)])
def test_two_ranks_save_to_an_object_store_and_restore_onto_three(backend, tmp_path, request):
    store = remote_store(backend, request)
    saved = ok(*launch("save", store, 2, tmp_path / "save"))
    assert run_cli("verify", store, "--all").returncode == 0
    for after in ok(*launch("restore", store, 3, tmp_path / "restore")):
        assert after["step"] == 2 and after["weight_exact"] and after["reset"] == ["rng"]
    again = ok(*launch("restore", store, 2, tmp_path / "again"))
    for before, after in zip(saved, again, strict=True):
        assert after["draw"] == before["after_save_draw"]


def test_an_encrypted_two_rank_run_restores_on_one_process(tmp_path, monkeypatch):
    monkeypatch.setenv("TEST_KEYSTORE", str(tmp_path / "keys"))
    store = tmp_path / "store"
    ok(*launch("save", store, 2, tmp_path / "save"))
    newest = sorted(store.glob("step-*"))[-1]
    names = sorted(p.name for p in newest.iterdir())
    data = [n for n in names if n.startswith("r0") and not n.endswith("-index.json")]
    assert all(n.endswith(".enc") for n in data), names  # indexes: digests and shapes only
    assert "tokens_seen" not in (newest / "manifest.json").read_text()  # state encrypted
    (after,) = ok(*launch("restore", store, 1, tmp_path / "restore"))
    assert after["step"] == 2 and after["weight_exact"] and after["meta"] == {"tokens_seen": 2000}


def _close(a: dict, b: dict) -> bool:
    return all(
        torch.allclose(torch.tensor(a[part][k]), torch.tensor(b[part][k]), rtol=1e-5, atol=1e-6)
        for part in ("params", "moments")
        for k in a[part]
    ) and all(set(a[part]) == set(b[part]) for part in ("params", "moments"))


@pytest.mark.parametrize(
    ("saved_on", "restored_on", "one_rank_group"),
    [(2, 3, False), (4, 1, False), (2, 1, True), (1, 2, True), (2, 2, False)],
)
def test_fsdp2_model_and_optimizer_reshard_across_world_sizes(
    tmp_path, monkeypatch, saved_on, restored_on, one_rank_group
):
    """A fully_shard-ed model and its AdamW, passed as on one process: every parameter
    and optimizer moment comes back bit-identical on another number of ranks (into a
    fresh optimizer, as shards), and training goes on from there. ``one_rank_group``:
    a side of one rank runs as under ``torchrun --nproc-per-node 1``, a process group
    and FSDP2 mesh of one rank, its parameters and moments DTensors (a restore there
    was StateMismatchError: mixed torch.Tensor and DTensor)."""
    if one_rank_group:
        monkeypatch.setenv("ONE_RANK_GROUP", "1")
    store = tmp_path / "store"
    (saved, *_) = ok(*launch("fsdp_save", store, saved_on, tmp_path / "save"))
    restored = ok(*launch("fsdp_restore", store, restored_on, tmp_path / "restore"))
    for after in restored:
        assert after["restored"] == saved["saved"]  # exact, every tensor whole
        assert after["sharded"] == (restored_on > 1)  # moments live as DTensor shards
        if restored_on == saved_on:
            assert after["after_step"] == saved["continued"]  # bit-exact resume
        else:  # gradients are averaged over another number of ranks
            assert _close(after["after_step"], saved["continued"])


def test_replicas_that_disagree_are_reported_or_refused(tmp_path):
    """DDP-style replicated state must be identical on every rank; a rank holding other
    bytes is silent data corruption. "warn" publishes and reports the ranks (log,
    audit entry, stats); "raise" publishes nothing and every rank raises."""
    store = tmp_path / "store"
    reports = ok(*launch("replicas_disagree", store, 2, tmp_path / "run"))
    assert published(store) == [1]
    for report in reports:
        assert report["mismatches"] == 2
        kind, message = report["error"]
        assert kind == "SaveFailedError" and "model/b: ranks 0 vs ranks 1" in message
        assert "model/r@0,0: ranks 0 vs ranks 1" in message
    entries = [json.loads(line) for line in (tmp_path / "audit.jsonl").read_text().splitlines()]
    (mismatch,) = [e for e in entries if e["event"] == "replica_mismatch"]
    assert mismatch["step"] == 1
    assert mismatch["slots"] == [
        {"slot": "model/b", "groups": [[0], [1]]},
        {"slot": "model/r@0,0", "groups": [[0], [1]]},
    ]


def test_async_saves_on_two_ranks_publish_once_each_and_restore_exactly(tmp_path):
    """Each rank's save returns after its staging copy; the ranks' background workers
    write and commit together."""
    store = tmp_path / "store"
    saved = ok(*launch("save_async", store, 2, tmp_path / "save"))
    assert published(store) == [1, 2]
    restored = ok(*launch("restore", store, 2, tmp_path / "restore"))
    for before, after in zip(saved, restored, strict=True):
        assert after["step"] == 2 and after["weight_exact"]
        assert after["draw"] == before["after_save_draw"]


def test_ranks_that_read_different_manifests_fall_back_together(two_rank_store, tmp_path):
    """Red-team finding (round 3): a manifest swapped while the ranks read it gave them
    different state under one generation name. The ranks now compare the manifest
    bytes they checked; a difference rejects the generation on every rank."""
    store, _saved = two_rank_store
    for after in ok(*launch("restore_diverging_manifest", store, 2, tmp_path)):
        assert after["step"] == 1 and after["meta"] == {"tokens_seen": 1000}
        ((step, reason),) = after["skipped"]
        assert step == 2 and "different manifest bytes" in reason


def test_a_signal_on_one_rank_stops_every_rank_at_the_same_final_save(tmp_path):
    store = tmp_path / "store"
    codes, reports = launch("preempt_one_rank", store, 2, tmp_path / "out")
    assert codes == [0, 0]
    assert [r["preempted_step"] for r in reports] == [3, 3]
    assert [r["code"] for r in reports] == [75, 75]
    with cv.CheckpointManager(store, run_id="job") as mgr:
        assert [g.step for g in mgr.generations()] == [3, 2, 1]
