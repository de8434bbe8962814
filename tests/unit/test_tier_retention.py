"""Retention per tier: the local tier keeps the last few, the replica its own policy
(milestones), and the local tier never deletes a generation before its copy exists.

Real POSIX stores on both tiers, the real replicator thread; the one stand-in is a
gate (or a failure) put in front of ``copy_generation`` to hold a copy back.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import UsageError
from ckptvault.replication import replicator as replication
from ckptvault.retention.plan import IN_FLIGHT
from ckptvault.storage import open_store
from ckptvault.storage.records import DELETION_MARK
from support.common import make_training_state, model_snapshot, run_cli, train_steps

LOCAL_LAST_TWO = cv.Retention(keep_last=2, delete_delay=0)
MILESTONES = cv.Retention(keep_every=4, delete_delay=0)


def steps_in(store: Path, *extra: str) -> list[int]:
    result = run_cli("ls", str(store), "--json", *extra)
    assert result.returncode == 0, result.stderr
    return [g["step"] for g in json.loads(result.stdout)]


def tiered(local: Path, remote: Path, **options: object) -> cv.CheckpointManager:
    return cv.CheckpointManager(local, run_id="r", replicate_to=remote, **options)


def test_local_keeps_the_last_two_and_the_replica_the_milestones(tmp_path: Path):
    local, remote, fresh_node = tmp_path / "local", tmp_path / "remote", tmp_path / "node2"
    state = make_training_state()
    snapshots = {}
    with tiered(local, remote, retention=LOCAL_LAST_TWO, replica_retention=MILESTONES) as mgr:
        for step in range(1, 10):
            train_steps(state, 1)
            snapshots[step] = model_snapshot(state["model"])
            mgr.save(step, state)
    assert mgr.replicator is not None and mgr.replicator.retention is not None
    replica_plan = mgr.replicator.retention.last_plan  # after close: every copy landed
    assert steps_in(local) == [9, 8]  # 8: the last two, and the fallback as well
    assert steps_in(remote) == [9, 8, 4]  # the milestones and the newest
    assert steps_in(local, "--all") == [9, 8] and steps_in(remote, "--all") == [9, 8, 4]
    assert replica_plan is not None
    reasons = {d.step: d.reasons for d in replica_plan.decisions}
    assert reasons[9][0] == "newest verified" and "keep_every=4" in reasons[4]
    # Deleting step 4 locally did not delete the replica's copy, nor leave marks behind.
    assert open_store(local).list_records(DELETION_MARK) == {}
    assert open_store(remote).list_records(DELETION_MARK) == {}
    assert run_cli("verify", str(remote), "--all").returncode == 0

    # A fresh node restores from the replica tier: the newest, and a milestone by step.
    with tiered(fresh_node, remote, retention=LOCAL_LAST_TWO, replica_retention=MILESTONES) as mgr:
        restored = make_training_state(seed=7)
        info = mgr.restore(restored)
        assert info is not None and info.step == 9 and info.path.startswith(str(remote))
        assert all(
            torch.equal(restored["model"].state_dict()[k], v) for k, v in snapshots[9].items()
        )
        milestone = make_training_state(seed=8)
        assert mgr.restore(milestone, step=4).step == 4
        assert all(
            torch.equal(milestone["model"].state_dict()[k], v) for k, v in snapshots[4].items()
        )
    assert steps_in(fresh_node) == [9, 4]  # both copied back to the new node's local tier
    assert steps_in(remote) == [9, 8, 4]  # restoring changed nothing there


def test_a_generation_is_never_deleted_locally_before_its_copy_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    local, remote = tmp_path / "local", tmp_path / "remote"
    gate = threading.Event()
    real_copy = replication.copy_generation

    def gated_copy(source, ref, target, policy=None, keystore=None):  # type: ignore[no-untyped-def]
        assert gate.wait(60), "the test never opened the gate"
        return real_copy(source, ref, target, policy, keystore)

    monkeypatch.setattr(replication, "copy_generation", gated_copy)
    keep_one = cv.Retention(keep_last=1, delete_delay=0)
    keep_all = cv.Retention(keep_last=100, delete_delay=0)
    with tiered(local, remote, retention=keep_one, replica_retention=keep_all) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((8,), float(step))})
        # Nothing has reached the replica yet: the local tier keeps all three.
        assert steps_in(local) == [3, 2, 1]
        assert mgr.retention is not None and mgr.retention.last_plan is not None
        held = {d.step: d.reasons for d in mgr.retention.last_plan.decisions}
        assert held[1] == (IN_FLIGHT,)
        assert mgr.replicator is not None and mgr.replicator.status().pending == 3
        gate.set()
        mgr.replicator.wait()
        # Once the copies landed the local tier planned again: back to its policy.
        assert steps_in(local) == [3, 2]  # keep_last=1, and the fallback
    assert steps_in(remote) == [3, 2, 1]


def test_a_failed_copy_is_kept_locally_and_tried_again_after_the_next_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    local, remote = tmp_path / "local", tmp_path / "remote"
    real_copy = replication.copy_generation
    failures = []

    def flaky_copy(source, ref, target, policy=None, keystore=None):  # type: ignore[no-untyped-def]
        if ref.step == 1 and not failures:
            failures.append(ref.step)
            raise OSError(5, "the network went away")
        return real_copy(source, ref, target, policy, keystore)

    monkeypatch.setattr(replication, "copy_generation", flaky_copy)
    keep_one = cv.Retention(keep_last=1, delete_delay=0)
    with tiered(local, remote, retention=keep_one, replica_retention=keep_one) as mgr:
        mgr.save(1, {"w": torch.ones(8)})
        assert mgr.replicator is not None
        mgr.replicator.wait()
        status = mgr.replicator.status()
        assert (status.pending, status.failures) == (1, 1)  # waits for another try
        assert mgr.replicator.unreplicated() == {
            ref.generation_id for ref in open_store(local).list_generations()
        }
        mgr.save(2, {"w": torch.full((8,), 2.0)})
        mgr.save(3, {"w": torch.full((8,), 3.0)})
        mgr.replicator.wait()
        assert mgr.replicator.status().pending == 0
    assert failures == [1]
    assert steps_in(local) == [3, 2]
    # Step 1 reached the replica (its policy then let it go: keep_last=1 and a fallback).
    assert steps_in(remote) == [3, 2]
    copied = open_store(local).list_records(replication.REPLICA_RECORD)
    assert any(name.startswith("step-000000000001.") for name in copied)


def test_what_an_earlier_process_left_uncopied_is_copied_first(tmp_path: Path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    with tiered(local, remote) as mgr:
        mgr.save(1, {"w": torch.ones(8)})
    with cv.CheckpointManager(local, run_id="r") as mgr:  # a run that died before copying
        mgr.save(2, {"w": torch.full((8,), 2.0)})
        mgr.save(3, {"w": torch.full((8,), 3.0)})
    assert steps_in(remote) == [1]
    keep_one = cv.Retention(keep_last=1, delete_delay=0)
    keep_all = cv.Retention(keep_last=100, delete_delay=0)
    with tiered(local, remote, retention=keep_one, replica_retention=keep_all) as mgr:
        mgr.save(4, {"w": torch.full((8,), 4.0)})
    assert steps_in(remote) == [4, 3, 2, 1]  # nothing was deleted locally before its copy
    assert steps_in(local) == [4, 3]


def test_one_policy_still_applies_to_both_tiers(tmp_path: Path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    with tiered(local, remote, retention=LOCAL_LAST_TWO) as mgr:
        for step in range(1, 6):
            mgr.save(step, {"w": torch.full((8,), float(step))})
        assert mgr.replicator is not None and mgr.replicator.retention is None
    assert steps_in(local) == [5, 4]
    assert steps_in(remote) == [5, 4]


def test_a_pin_made_locally_keeps_the_replica_copy(tmp_path: Path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    keep_one = cv.Retention(keep_last=1, delete_delay=0)
    with tiered(local, remote, retention=keep_one, replica_retention=keep_one) as mgr:
        mgr.save(1, {"w": torch.ones(8)})
        mgr.pin(1)
        for step in (2, 3, 4):
            mgr.save(step, {"w": torch.full((8,), float(step))})
    assert steps_in(local) == [4, 3, 1]
    assert steps_in(remote) == [4, 3, 1]


def test_gc_applies_its_rules_to_the_one_store_it_is_given(tmp_path: Path):
    local, remote = tmp_path / "local", tmp_path / "remote"
    with tiered(local, remote) as mgr:
        for step in range(1, 6):
            mgr.save(step, {"w": torch.full((8,), float(step))})
    result = run_cli("gc", str(remote), "--keep-every", "2", "--delete-delay", "0s", "--json")
    assert result.returncode == 0, result.stdout + result.stderr
    assert steps_in(remote) == [5, 4, 2]  # milestones, the newest and its fallback
    assert steps_in(local) == [5, 4, 3, 2, 1]  # untouched


def test_replica_retention_usage_errors(tmp_path: Path):
    with pytest.raises(UsageError, match="needs replicate_to"):
        cv.CheckpointManager(
            tmp_path / "local", run_id="r", replica_retention=cv.Retention(keep_last=1)
        )
    with pytest.raises(UsageError, match=r"replica_retention must be a ckptvault\.Retention"):
        cv.CheckpointManager(
            tmp_path / "local",
            run_id="r",
            replicate_to=tmp_path / "remote",
            replica_retention={"keep_last": 1},  # type: ignore[typeddict-item]
        )


def test_one_policy_never_leaves_the_replica_without_a_generation_while_copies_lag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Found by the crash harness: with one policy for both tiers, generations not yet
    copied counted toward ``keep_last``, so the older, copied ones were marked and
    deleted in both tiers, and the durable tier held nothing restorable while copies
    lagged (a node lost then lost the run). Until a copy lands, it does not count."""
    local, remote = tmp_path / "local", tmp_path / "remote"
    gate = threading.Event()
    real_copy = replication.copy_generation

    def gated_copy(source, ref, target, policy=None, keystore=None):  # type: ignore[no-untyped-def]
        if ref.step > 1:
            assert gate.wait(60), "the test never opened the gate"
        return real_copy(source, ref, target, policy, keystore)

    monkeypatch.setattr(replication, "copy_generation", gated_copy)
    keep_one = cv.Retention(keep_last=1, delete_delay=0)
    try:
        with tiered(local, remote, retention=keep_one) as mgr:
            mgr.save(1, {"w": torch.ones(8)})
            assert mgr.replicator is not None
            mgr.replicator.wait()
            for step in (2, 3, 4):
                mgr.save(step, {"w": torch.full((8,), float(step))})
            # The replica still holds step 1, unmarked: a new node restores it.
            assert steps_in(remote) == [1] and steps_in(remote, "--all") == [1]
            with cv.CheckpointManager(remote, run_id="r") as reader:
                restored = {"w": torch.zeros(8)}
                info = reader.restore(restored)
                assert (
                    info is not None
                    and info.step == 1
                    and torch.equal(restored["w"], torch.ones(8))
                )
            assert steps_in(local) == [4, 3, 2, 1]  # nothing copied yet: nothing dropped
            gate.set()
            mgr.replicator.wait()
    finally:
        gate.set()  # a failing check must not leave the copy thread waiting
    # Once the copies landed, the policy applies to both tiers again.
    assert steps_in(local) == [4, 3]  # keep_last=1, and the fallback
    assert steps_in(remote) == [4, 3]
