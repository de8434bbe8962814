"""Tiers with the replica in an S3 bucket (``replicate_to="s3://bucket/prefix"``).

Each test runs twice, on moto and on SeaweedFS (``each_s3_bucket``), S3-protocol
servers on loopback; the replica store finds the server through ``AWS_ENDPOINT_URL``,
as a user's boto3 configuration would.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import ckptvault as cv
from support.common import make_training_state, model_snapshot, run_cli, train_steps
from support.s3_server import s3_client


def steps_in(store: str | Path) -> list[int]:
    result = run_cli("ls", str(store), "--json")
    assert result.returncode == 0, result.stderr
    return [g["step"] for g in json.loads(result.stdout)]


def keys_under(endpoint: str, bucket: str, prefix: str) -> list[str]:
    listed = s3_client(endpoint).list_objects_v2(Bucket=bucket, Prefix=prefix)
    return [str(o["Key"]) for o in listed.get("Contents", [])]


def test_save_locally_replicate_to_s3_restore_on_a_fresh_node_and_copy_back(
    tmp_path: Path, each_s3_bucket: str, each_s3_endpoint: str
):
    local, fresh_node = tmp_path / "local", tmp_path / "node2"
    remote = f"s3://{each_s3_bucket}/run42"
    state = make_training_state()
    with cv.CheckpointManager(local, run_id="run42", replicate_to=remote) as mgr:
        for step in (1, 2):
            train_steps(state, 1)
            mgr.save(step, state)
        assert mgr.replicator is not None
        mgr.replicator.wait()
        assert mgr.replicator.status().failures == 0
    expected = model_snapshot(state["model"])
    assert steps_in(remote) == steps_in(local) == [2, 1]
    assert run_cli("verify", remote, "--all").returncode == 0

    with cv.CheckpointManager(fresh_node, run_id="run42", replicate_to=remote) as mgr:
        restored = make_training_state(seed=3)
        info = mgr.restore(restored)
        assert info is not None and info.step == 2 and info.path.startswith(remote)
    assert all(torch.equal(restored["model"].state_dict()[k], v) for k, v in expected.items())
    assert steps_in(fresh_node) == [2]  # copied back from S3
    with cv.CheckpointManager(fresh_node, run_id="run42", replicate_to=remote) as mgr:
        again = mgr.restore(make_training_state(seed=4))
        assert again is not None and again.path.startswith(str(fresh_node))


def test_one_policy_deletes_from_the_local_tier_and_the_bucket(
    tmp_path: Path, each_s3_bucket: str, each_s3_endpoint: str
):
    local, remote = tmp_path / "local", f"s3://{each_s3_bucket}/run42"
    retention = cv.Retention(keep_last=2, delete_delay=0)
    saved = {}
    with cv.CheckpointManager(
        local, run_id="run42", replicate_to=remote, retention=retention
    ) as mgr:
        for step in range(1, 6):
            saved[step] = mgr.save(step, {"w": torch.full((64,), float(step))}).result()
    assert steps_in(local) == steps_in(remote) == [5, 4]
    keys = keys_under(each_s3_endpoint, each_s3_bucket, "run42/")
    for step in (1, 2, 3):  # nothing of a deleted generation stays in the bucket
        assert not [key for key in keys if saved[step].generation_id in key], step
    assert not [key for key in keys if "/.records/deleted/" in key]


def test_per_tier_policies_with_the_replica_in_s3(
    tmp_path: Path, each_s3_bucket: str, each_s3_endpoint: str
):
    local, fresh_node = tmp_path / "local", tmp_path / "node2"
    remote = f"s3://{each_s3_bucket}/run42"
    policies = {
        "retention": cv.Retention(keep_last=2, delete_delay=0),
        "replica_retention": cv.Retention(keep_every=3, delete_delay=0),
    }
    with cv.CheckpointManager(local, run_id="run42", replicate_to=remote, **policies) as mgr:
        for step in range(1, 8):
            mgr.save(step, {"w": torch.full((64,), float(step))})
    assert steps_in(local) == [7, 6]
    assert steps_in(remote) == [7, 6, 3]  # the newest, its fallback (a milestone), milestones
    with cv.CheckpointManager(fresh_node, run_id="run42", replicate_to=remote, **policies) as mgr:
        state = {"w": torch.zeros(64)}
        info = mgr.restore(state, step=3)
        assert info is not None and info.path.startswith(remote)
    assert torch.equal(state["w"], torch.full((64,), 3.0))
