"""Azure Blob stores (``az://container/prefix``) against Azurite, end to end.

Azurite (``support.azurite_server``) runs for the session; ``azure_container`` points
``AZURE_STORAGE_CONNECTION_STRING`` at it for the test, as a user's environment
would, and so for the CLI processes the tests start. What these tests check is what
a user relies on: a save killed mid-upload leaves nothing visible and ``gc`` removes
what it staged, a local run replicates to ``az://`` and restores from it on a fresh
node, retention deletes old generations' blobs, and the command-line tools take an
``az://`` URL wherever they take an ``s3://`` one.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptvault as cv
from ckptvault.storage import open_store
from ckptvault.trust.signing import generate_keypair
from support.azurite_server import service_client
from support.common import (
    make_training_state,
    model_snapshot,
    run_cli,
    run_cli_process,
    train_steps,
)

WORKER = Path(__file__).resolve().parents[1] / "support" / "azure_crash_worker.py"
TENSOR_FILE = "r00000-000.safetensors"


def container_of(conn_str: str, name: str) -> Any:
    return service_client(conn_str).get_container_client(name)


def blob_names(container: Any, prefix: str, *, uncommitted: bool = False) -> list[str]:
    include = ["uncommittedblobs"] if uncommitted else None
    return sorted(b.name for b in container.list_blobs(name_starts_with=prefix, include=include))


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """``ckptvault ARGS`` in this process, its output captured as through a pipe
    (a fresh interpreter per command would cost seconds each here)."""
    return run_cli(*args, timeout=120)


def steps_in(store: str | Path) -> list[int]:
    result = cli("ls", str(store), "--json")
    assert result.returncode == 0, result.stderr
    return [g["step"] for g in json.loads(result.stdout)]


def test_the_cli_reads_verifies_signs_exports_and_collects_an_az_store(
    azure_container: str, azure_env: str, tmp_path: Path
):
    url = f"az://{azure_container}/run42"
    with cv.CheckpointManager(url, run_id="run42") as mgr:
        saved = {
            step: mgr.save(step, {"w": torch.arange(32.0) + step, "meta": {"epoch": step}}).result()
            for step in (5, 6, 7)
        }
    info = saved[7]
    assert info.path == f"{url}/generations/step-000000000007.{info.generation_id}"

    listed = run_cli_process("ls", url, "--json")  # a process of its own, through a pipe
    assert listed.returncode == 0, listed.stderr
    assert [(g["step"], g["path"]) for g in json.loads(listed.stdout)] == [
        (step, saved[step].path) for step in (7, 6, 5)
    ]
    verified = cli("verify", url, "--all")
    assert verified.returncode == 0, verified.stdout + verified.stderr
    inspected = cli("inspect", url, "--json")
    assert inspected.returncode == 0, inspected.stderr
    assert json.loads(inspected.stdout)["generation"]["step"] == 7
    status = cli("status", url, "--json")
    assert status.returncode in (0, 1), status.stderr  # 1: an alert (saves seem stale)
    health = json.loads(status.stdout)
    assert (health["store"], health["generations"], health["last_good_step"]) == (url, 3, 7)

    collected = cli("gc", url, "--keep-last", "1", "--delete-delay", "0s", "--json")
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert steps_in(url) == [7, 6]  # the newest and its verified fallback
    names = blob_names(container_of(azure_env, azure_container), "run42/", uncommitted=True)
    assert names and all(key.startswith("run42/") for key in names)
    assert not [key for key in names if saved[5].generation_id in key]  # every blob of 5 went
    kept = {saved[7].generation_id, saved[6].generation_id}
    data = [key for key in names if key.startswith("run42/data/")]
    assert {key.split("/")[3] for key in data} == kept

    # Signed after the fact, verified against the key; one entry exported.
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    signed = cli("sign", url, "--signing-key", str(tmp_path / "k.pem"), "--all")
    assert signed.returncode == 0 and "2 signed" in signed.stdout, signed.stdout + signed.stderr
    trusted = cli("verify", url, "--all", "--trusted-key", str(tmp_path / "k.pub"))
    assert trusted.returncode == 0, trusted.stdout + trusted.stderr
    exported = cli("export", url, "--key", "w", "--out", str(tmp_path / "w.safetensors"))
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert torch.equal(load_file(tmp_path / "w.safetensors")["w"], torch.arange(32.0) + 7)

    # A flipped byte in the one blob a name maps to: verify refuses and says why.
    blob = container_of(azure_env, azure_container).get_blob_client(
        next(key for key in data if key.endswith(TENSOR_FILE) and info.generation_id in key)
    )
    body = bytearray(blob.download_blob().readall())
    body[-1] ^= 0xFF
    blob.upload_blob(bytes(body), overwrite=True)
    refused = cli("verify", url)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "digest-mismatch" in refused.stdout + refused.stderr

    missing = run_cli_process("ls", f"az://ckv-no-such-{azure_container[4:]}/x")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.startswith("ckptvault: error: ") and "does not exist" in missing.stderr


def test_a_wrong_account_key_is_refused_saying_where_the_account_comes_from(
    azure_container: str, azure_env: str, monkeypatch: pytest.MonkeyPatch
):
    with cv.CheckpointManager(f"az://{azure_container}/run", run_id="run") as mgr:
        mgr.save(1, {"w": torch.ones(4)})
    wrong = azure_env.replace("AccountKey=Eby8", "AccountKey=Xby8")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", wrong)
    refused = cli("ls", f"az://{azure_container}/run")
    assert refused.returncode == 2 and refused.stdout == ""
    (line,) = refused.stderr.splitlines()
    assert line.startswith("ckptvault: error: ") and azure_container in line
    assert "AZURE_STORAGE_CONNECTION_STRING" in line and "DefaultAzureCredential" in line


@pytest.mark.timeout(240)
def test_a_save_killed_mid_upload_leaves_nothing_visible_and_gc_removes_it(
    azure_container: str, azure_env: str
):
    url = f"az://{azure_container}/crash"
    container = container_of(azure_env, azure_container)
    worker = subprocess.Popen(
        [sys.executable, str(WORKER), url],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None
        assert worker.stdout.readline().strip() == "saved 1", worker.stderr
        deadline = time.monotonic() + 120
        while _blocks_staged(container, "crash/data/") < 2:  # mid-way through step 2's upload
            assert time.monotonic() < deadline and worker.poll() is None, "no upload seen"
            time.sleep(0.05)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    store = open_store(url)
    [published] = store.list_generations()
    assert published.step == 1
    staged = set(blob_names(container, "crash/", uncommitted=True)) - set(
        blob_names(container, "crash/")
    )
    assert staged, "the kill left no staged blocks: it came too late to test anything"

    state = {"w": torch.zeros(10)}
    with cv.CheckpointManager(url, run_id="crash") as mgr:
        info = mgr.restore(state)
        assert info is not None and info.step == 1 and torch.equal(state["w"], torch.arange(10.0))

    collected = cli("gc", url, "--stale-after", "0s", "--json")
    assert collected.returncode == 0, collected.stdout + collected.stderr
    assert not set(blob_names(container, "crash/", uncommitted=True)) & staged
    data = blob_names(container, "crash/data/", uncommitted=True)
    assert data and all(f"/{published.generation_id}/" in key for key in data)
    with cv.CheckpointManager(url, run_id="crash") as mgr:
        mgr.save(2, {"w": torch.ones(10)})  # the killed writer's lease does not block it
    assert [ref.step for ref in store.list_generations()] == [2, 1]


def _blocks_staged(container: Any, prefix: str) -> int:
    """Blocks staged and not committed under ``prefix``."""
    committed = set(blob_names(container, prefix))
    return sum(
        len(container.get_blob_client(name).get_block_list("uncommitted")[1])
        for name in blob_names(container, prefix, uncommitted=True)
        if name not in committed
    )


def test_save_locally_replicate_to_az_and_restore_on_a_fresh_node(
    tmp_path: Path, azure_container: str
):
    local, fresh_node = tmp_path / "local", tmp_path / "node2"
    remote = f"az://{azure_container}/run42"
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
    assert cli("verify", remote, "--all").returncode == 0

    with cv.CheckpointManager(fresh_node, run_id="run42", replicate_to=remote) as mgr:
        restored = make_training_state(seed=3)
        info = mgr.restore(restored)
        assert info is not None and info.step == 2 and info.path.startswith(remote)
    assert all(torch.equal(restored["model"].state_dict()[k], v) for k, v in expected.items())
    assert steps_in(fresh_node) == [2]  # copied back from Azure


def test_one_policy_deletes_from_the_local_tier_and_the_container(
    tmp_path: Path, azure_container: str, azure_env: str
):
    local, remote = tmp_path / "local", f"az://{azure_container}/run42"
    retention = cv.Retention(keep_last=2, delete_delay=0)
    saved = {}
    with cv.CheckpointManager(
        local, run_id="run42", replicate_to=remote, retention=retention
    ) as mgr:
        for step in range(1, 6):
            saved[step] = mgr.save(step, {"w": torch.full((64,), float(step))}).result()
    assert steps_in(local) == steps_in(remote) == [5, 4]
    names = blob_names(container_of(azure_env, azure_container), "run42/", uncommitted=True)
    for step in (1, 2, 3):  # nothing of a deleted generation stays in the container
        assert not [key for key in names if saved[step].generation_id in key], step
    assert not [key for key in names if "/.records/deleted/" in key]


def test_per_tier_policies_with_the_replica_in_az(tmp_path: Path, azure_container: str):
    local, fresh_node = tmp_path / "local", tmp_path / "node2"
    remote = f"az://{azure_container}/run42"
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
