"""Restore: newest generation that verifies, each rejection with its own reason,
fallback, and a caller's state left untouched whenever restore raises."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptvault as cv
from ckptvault.errors import ContractMismatch, NoValidCheckpoint, StateMismatchError
from support.common import (
    assert_same_tensors,
    make_training_state,
    model_snapshot,
    only_tensor_file,
    train_steps,
    writable,
)


@pytest.fixture
def two_generations(store: Path):
    """A store with steps 1 and 2 and the model weights each holds."""
    state = make_training_state()
    weights = {}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        for step in (1, 2):
            train_steps(state, 2)
            weights[step] = model_snapshot(state["model"])
            mgr.save(step, state)
        paths = {g.step: Path(g.path) for g in mgr.generations()}
    return paths, weights


def _flip_byte(path: Path, offset: int = -1) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    writable(path).write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    writable(path).write_bytes(data[:-100])


def _remove(path: Path) -> None:
    path.unlink()


def _add_extra(path: Path) -> None:
    (path.parent / "notes.txt").write_text("extra")


@pytest.mark.parametrize(
    ("damage", "code"),
    [
        (_flip_byte, "digest-mismatch"),
        (_truncate, "size-mismatch"),
        (_remove, "file-missing"),
        (_add_extra, "file-extra"),
    ],
)
def test_tampered_newest_falls_back_with_its_reason(store, two_generations, damage, code):
    paths, weights = two_generations
    damage(only_tensor_file(paths[2]))
    fresh = make_training_state(seed=9)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(fresh)
    assert info.step == 1
    assert len(info.skipped) == 1
    skipped = info.skipped[0]
    assert skipped.step == 2 and skipped.generation_id == paths[2].name.split(".", 1)[1]
    assert skipped.reason.startswith(code), skipped.reason
    assert_same_tensors(model_snapshot(fresh["model"]), weights[1])


def test_each_damage_has_a_distinct_reason(store, two_generations):
    _paths, _ = two_generations
    reasons = set()
    for damage in (_flip_byte, _truncate, _remove, _add_extra):
        # Rebuild a damaged copy of step 2 each time from a fresh save.
        state = make_training_state()
        with cv.CheckpointManager(store, run_id="r") as mgr:
            path = Path(mgr.save(3, state).result().path)
            damage(only_tensor_file(path))
            info = mgr.restore(make_training_state(seed=4))
            reasons.add(info.skipped[0].reason.split(":")[0])
            shutil.rmtree(path)
    assert len(reasons) == 4


def test_flipped_byte_in_the_header_is_caught(store, two_generations):
    paths, _ = two_generations
    _flip_byte(only_tensor_file(paths[2]), offset=20)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(make_training_state())
    assert info.step == 1 and info.skipped[0].step == 2


def test_every_candidate_failing_leaves_state_untouched(store, two_generations):
    paths, _ = two_generations
    _flip_byte(only_tensor_file(paths[2]))
    _remove(only_tensor_file(paths[1]))
    state = make_training_state(seed=11)
    train_steps(state, 1)
    before_model = model_snapshot(state["model"])
    before_opt = {k: v.clone() for k, v in state["optimizer"].state_dict()["state"][0].items()}
    before_meta = json.dumps(state["meta"])
    before_rng = torch.get_rng_state().clone()
    with cv.CheckpointManager(store, run_id="r") as mgr, pytest.raises(NoValidCheckpoint) as raised:
        mgr.restore(state)
    message = str(raised.value)
    assert "digest-mismatch" in message and "file-missing" in message
    assert [(gen, step) for gen, step, _ in raised.value.rejected] == [
        (paths[2].name.split(".", 1)[1], 2),
        (paths[1].name.split(".", 1)[1], 1),
    ]
    assert_same_tensors(model_snapshot(state["model"]), before_model)
    for key, value in before_opt.items():
        assert torch.equal(state["optimizer"].state_dict()["state"][0][key], value)
    assert json.dumps(state["meta"]) == before_meta
    assert torch.equal(torch.get_rng_state(), before_rng)


def test_empty_store_returns_none(store: Path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert mgr.restore(make_training_state()) is None
        assert mgr.generations() == []
        with pytest.raises(NoValidCheckpoint, match="no generation"):
            mgr.restore(make_training_state(), step=3)


def test_restore_a_given_step(store, two_generations):
    _, weights = two_generations
    fresh = make_training_state(seed=2)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert mgr.restore(fresh, step=1).step == 1
        with pytest.raises(NoValidCheckpoint, match="steps present: 1, 2"):
            mgr.restore(fresh, step=7)
    assert_same_tensors(model_snapshot(fresh["model"]), weights[1])


def test_generation_of_another_run_is_skipped(store, two_generations):
    _paths, weights = two_generations
    other = make_training_state(seed=3)
    with cv.CheckpointManager(store, run_id="intruder") as mgr:
        mgr.save(9, other)
    fresh = make_training_state(seed=4)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(fresh)
    assert info.step == 2 and info.skipped[0].step == 9
    assert info.skipped[0].reason.startswith("run-mismatch")
    assert_same_tensors(model_snapshot(fresh["model"]), weights[2])


def test_generations_lists_step_id_path_bytes_created(store, two_generations):
    paths, _ = two_generations
    with cv.CheckpointManager(store, run_id="r") as mgr:
        listed = mgr.generations()
    assert [g.step for g in listed] == [2, 1]
    for g in listed:
        assert Path(g.path) == paths[g.step] and g.bytes > 0 and g.created_at.endswith("Z")
        assert g.bytes == sum(
            p.stat().st_size for p in paths[g.step].iterdir() if p.name != "manifest.json"
        )


def test_strict_mismatch_lists_entries_and_touches_nothing(store: Path):
    state = make_training_state(width=16)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, state)
    other = make_training_state(seed=5, width=32)
    other["extra"] = torch.zeros(2)
    del other["scheduler"]
    before = model_snapshot(other["model"])
    with (
        cv.CheckpointManager(store, run_id="r") as mgr,
        pytest.raises(StateMismatchError) as raised,
    ):
        mgr.restore(other)
    error = raised.value
    assert "state['extra']" in error.missing
    assert "state['scheduler']" in error.unexpected
    assert any("fc1.weight" in m and "[16, 8]" in m and "[32, 8]" in m for m in error.mismatched)
    assert_same_tensors(model_snapshot(other["model"]), before)


def test_non_strict_loads_what_matches_and_reports_the_rest(store: Path):
    source = {"model": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)), "step": 7}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, source)
    target = {"model": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)), "new": 1}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(target, strict=False)
    assert torch.equal(target["model"][0].weight, source["model"][0].weight)
    assert not torch.equal(target["model"][1].bias[:2], source["model"][1].bias)
    assert any("1.weight" in m for m in info.mismatched)
    assert "state['new']" in info.missing and "state['step']" in info.unexpected
    assert "step" not in target


def test_contract_change_is_refused_unless_allowed(store: Path):
    state = make_training_state()
    contract = {"config": {"lr": 0.01, "layers": 2}, "dataset": "ds-v3"}
    with cv.CheckpointManager(store, run_id="r", contract=contract) as mgr:
        mgr.save(1, state)
    fresh = make_training_state(seed=8)
    before = model_snapshot(fresh["model"])
    changed = {"config": {"lr": 0.02, "layers": 2}, "dataset": "ds-v4"}
    with cv.CheckpointManager(store, run_id="r", contract=changed) as mgr:
        with pytest.raises(ContractMismatch) as raised:
            mgr.restore(fresh)
        assert raised.value.fields == ["config", "dataset"]
        assert "allow_contract_change" in str(raised.value)
        assert_same_tensors(model_snapshot(fresh["model"]), before)
        assert mgr.restore(fresh, allow_contract_change=True).step == 1
    reordered = {"dataset": "ds-v3", "config": {"layers": 2, "lr": 0.01}}
    with cv.CheckpointManager(store, run_id="r", contract=reordered) as mgr:
        assert mgr.restore(make_training_state()).step == 1


def test_kind_mismatch_is_reported(store: Path):
    model = torch.nn.Linear(2, 2)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"thing": model})
    opt = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    with (
        cv.CheckpointManager(store, run_id="r") as mgr,
        pytest.raises(StateMismatchError, match="module"),
    ):
        mgr.restore({"thing": opt})


def test_renamed_generation_directory_is_refused(store, two_generations):
    paths, _ = two_generations
    gen_id = paths[1].name.split(".", 1)[1]
    paths[1].rename(store / f"step-{3:012d}.{gen_id}")
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(make_training_state())
    assert info.step == 2
    with (
        cv.CheckpointManager(store, run_id="r") as mgr,
        pytest.raises(NoValidCheckpoint, match="name-mismatch"),
    ):
        mgr.restore(make_training_state(), step=3)


def test_flipped_byte_in_the_manifest_is_caught(store, two_generations):
    paths, weights = two_generations
    manifest = paths[2] / "manifest.json"
    data = bytearray(manifest.read_bytes())
    at = data.index(b'"tokens_seen"') + len(b'"tokens_seen"') + 2  # inside the number
    data[at] ^= 0x01  # 16 -> 17, still canonical JSON
    writable(manifest).write_bytes(bytes(data))
    fresh = make_training_state(seed=3)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(fresh)
    assert info.step == 1 and info.skipped[0].reason.startswith("manifest-corrupt")
    assert_same_tensors(model_snapshot(fresh["model"]), weights[1])


def test_other_optimizer_class_is_a_mismatch_and_touches_nothing(store: Path):
    model = torch.nn.Linear(3, 3)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"model": model, "optimizer": sgd})
    target_model = torch.nn.Linear(3, 3)
    adam = torch.optim.Adam(target_model.parameters(), lr=0.5)
    before = target_model.weight.detach().clone()
    with (
        cv.CheckpointManager(store, run_id="r") as mgr,
        pytest.raises(StateMismatchError, match="SGD"),
    ):
        mgr.restore({"model": target_model, "optimizer": adam})
    assert torch.equal(target_model.weight, before)
    assert adam.param_groups[0]["lr"] == 0.5 and "betas" in adam.param_groups[0]


def test_live_objects_the_checkpoint_lacks_are_kept_and_reported(store: Path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"heads": [torch.nn.Linear(2, 2)], "extras": {"a": 1}})
    heads = [torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]
    generator = np.random.default_rng(0)
    extras = {"a": 5, "gen": generator, "deep": {"t": torch.ones(2)}}
    state = {"heads": heads, "extras": extras}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        with pytest.raises(StateMismatchError) as raised:
            mgr.restore(state)
        assert "state['heads'][1]" in raised.value.missing
        assert "state['extras']['gen']" in raised.value.missing
        assert "state['extras']['deep']" in raised.value.missing
        assert len(heads) == 2 and extras["a"] == 5
        info = mgr.restore(state, strict=False)
    assert len(heads) == 2 and extras["gen"] is generator and extras["a"] == 1
    assert "state['heads'][1]" in info.missing


@pytest.mark.parametrize("chunk_size", [7, 1000, 4096, 1 << 20])
def test_restore_across_chunk_and_tensor_boundaries(tmp_path: Path, chunk_size: int):
    torch.manual_seed(chunk_size)
    tensors = {
        "big": torch.randn(3000),
        "odd": torch.randint(0, 100, (333,), dtype=torch.int16),
        "many": {str(i): torch.randn(i % 5 + 1) for i in range(700)},  # > 512 pieces per chunk
        "bf16": torch.randn(1001).to(torch.bfloat16),
        "scalar": torch.tensor(2.5, dtype=torch.float64),
    }
    store = tmp_path / f"s{chunk_size}"
    with cv.CheckpointManager(store, run_id="r", chunk_size=chunk_size) as mgr:
        path = Path(mgr.save(1, {"t": tensors}).result().path)
        restored = {"t": {}}
        mgr.restore(restored)
        got = restored["t"]
        assert torch.equal(got["big"], tensors["big"]) and torch.equal(got["odd"], tensors["odd"])
        assert torch.equal(got["bf16"], tensors["bf16"]) and torch.equal(
            got["scalar"], tensors["scalar"]
        )
        assert all(torch.equal(got["many"][k], v) for k, v in tensors["many"].items())
        # A flipped byte anywhere in the data is caught.
        shard = only_tensor_file(path)
        data = bytearray(shard.read_bytes())
        data[-50] ^= 0x10  # in the data region (the header is checked structurally)
        writable(shard).write_bytes(bytes(data))
        with pytest.raises(NoValidCheckpoint, match="digest-mismatch"):
            mgr.restore({"t": {}})
