"""Tiers: a fast local store that is restorable at once, and a durable one that
every published generation is copied to in the background, verified."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from support.common import (
    make_training_state,
    model_snapshot,
    only_tensor_file,
    run_cli,
    train_steps,
    writable,
)


def steps_in(store: Path) -> list[int]:
    result = run_cli("ls", str(store), "--json")
    assert result.returncode == 0, result.stderr
    return [g["step"] for g in json.loads(result.stdout)]


def test_every_published_generation_reaches_the_remote_tier(tmp_path: Path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    state = make_training_state()
    with cv.CheckpointManager(local, run_id="r", replicate_to=remote) as mgr:
        for step in (1, 2, 3):
            train_steps(state, 1)
            mgr.save(step, state)
        mgr.replicator.wait()
        status = mgr.replicator.status()
        assert (status.pending, status.failures, status.lag_seconds) == (0, 0, 0.0)
    assert steps_in(remote) == steps_in(local) == [3, 2, 1]
    assert run_cli("verify", str(remote), "--all").returncode == 0
    # Same generation ids, same manifest bytes: the copy is the generation itself.
    for local_gen in local.glob("step-*"):
        remote_gen = remote / local_gen.name
        assert (remote_gen / "manifest.json").read_bytes() == (
            local_gen / "manifest.json"
        ).read_bytes()


def test_a_new_node_restores_from_the_remote_tier_and_keeps_a_local_copy(tmp_path: Path):
    local, remote, fresh_node = tmp_path / "local", tmp_path / "remote", tmp_path / "node2"
    state = make_training_state()
    with cv.CheckpointManager(local, run_id="r", replicate_to=remote) as mgr:
        train_steps(state, 2)
        mgr.save(7, state)
    expected = model_snapshot(state["model"])
    with cv.CheckpointManager(fresh_node, run_id="r", replicate_to=remote) as mgr:
        restored = make_training_state(seed=5)
        info = mgr.restore(restored)
        assert info.step == 7 and info.path.startswith(str(remote))
    assert all(torch.equal(restored["model"].state_dict()[k], v) for k, v in expected.items())
    assert steps_in(fresh_node) == [7]  # copied back: the next restore is local
    with cv.CheckpointManager(fresh_node, run_id="r", replicate_to=remote) as mgr:
        assert mgr.restore(make_training_state(seed=6)).path.startswith(str(fresh_node))


def test_the_newest_valid_copy_wins_and_local_is_preferred(tmp_path: Path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    state = make_training_state()
    with cv.CheckpointManager(local, run_id="r", replicate_to=remote) as mgr:
        for step in (1, 2):
            train_steps(state, 1)
            mgr.save(step, state)
    newest_local = next(local.glob("step-000000000002.*"))
    shard = writable(only_tensor_file(newest_local))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with cv.CheckpointManager(local, run_id="r", replicate_to=remote) as mgr:
        info = mgr.restore(make_training_state(seed=3))
    # Step 2 is damaged locally but intact remotely: the remote copy of step 2 beats
    # the local copy of step 1, and the damaged local copy is reported.
    assert info.step == 2 and info.path.startswith(str(remote))
    assert [s.step for s in info.skipped] == [2] and "digest-mismatch" in info.skipped[0].reason


def test_a_copy_that_does_not_verify_is_never_published_remotely(tmp_path: Path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    with cv.CheckpointManager(local, run_id="r") as mgr:
        # Two digest chunks: the flipped byte lies beyond the header, in the data that
        # only the copy itself reads.
        info = mgr.save(1, {"x": torch.ones(1_500_000)}).result()
    shard = writable(only_tensor_file(Path(info.path)))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    from ckptvault.replication.replicator import copy_generation
    from ckptvault.storage import open_store

    source, target = open_store(local), open_store(remote)
    target.acquire_writer()
    try:
        ref = source.list_generations()[0]
        with pytest.raises(cv.errors.IntegrityError, match="do not match"):
            copy_generation(source, ref, target)
    finally:
        target.release_writer()
    assert steps_in(remote) == []
    assert not any((remote / ".staging").iterdir())
