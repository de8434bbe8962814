"""The memory tier on one node (``CheckpointManager(memory_tier=cv.MemoryTier(...))``).

A real process saves a model and its optimizer at every step 1..13 into a memory
tier (durable every 5th save) and is SIGKILLed. A new process then restores:

- from memory (``source == "memory"``), step 13, bit-exact;
- with the memory tier emptied (a lost node), step 10 from the store;
- with one byte of the memory copy changed, nothing from it: the memory tier's
  verified fallback (step 12), or without it the store's step 10;

plain, and signed and encrypted (the ledger, trusted keys and a key store: the memory
generations are signed, MAC'd and in the ledger like stored ones). A memory tier
with no room (a 1 MiB tmpfs) skips its copies with a warning; training goes on and
the durable saves still happen. Its directory is private: a link or a directory
others can write is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import UsageError
from ckptvault.trust.signing import generate_keypair
from support.common import mounted_tmpfs


def _child(root: Path, trust: dict[str, Any], memory: Path) -> str:
    return f"""
import hashlib, json, os, signal
import torch
import ckptvault as cv

torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
digests = {{}}
mgr = cv.CheckpointManager({str(root / "store")!r}, run_id="mem", **{trust!r},
                           memory_tier=cv.MemoryTier(path={str(memory)!r}, keep=1, durable_every=5))
for step in range(1, 14):
    model(torch.randn(8, 64)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    mgr.save(step, {{"model": model, "optim": optimizer}}, blocking=True)
    digests[step] = hashlib.sha256(model.weight.detach().numpy().tobytes()).hexdigest()
open({str(root / "digests.json")!r}, "w").write(json.dumps(digests))
os.kill(os.getpid(), signal.SIGKILL)  # a crash: no close, no cleanup
"""


def _trust(root: Path, signed: bool) -> dict[str, Any]:
    options: dict[str, Any] = {
        "ledger": str(root / "ledger.db"),
        "audit_log": str(root / "audit.jsonl"),
    }
    if signed:
        generate_keypair(root / "key.pem", root / "key.pub")
        options.update(
            signing_key=str(root / "key.pem"),
            trusted_keys=[str(root / "key.pub")],
            keystore=str(root / "keys"),
        )
    return options


@pytest.fixture(params=["plain", "signed+encrypted"], scope="module")
def killed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A run SIGKILLed after saving steps 1..13 (memory every step, store every 5th)."""
    root = tmp_path_factory.mktemp(request.param.replace("+", "-"))
    trust = _trust(root, request.param != "plain")
    memory = root / "memory"
    result = subprocess.run(
        [sys.executable, "-c", _child(root, trust, memory)], capture_output=True, text=True
    )
    assert result.returncode == -9, result.stderr[-3000:]
    digests = json.loads((root / "digests.json").read_text())
    return {"root": root, "trust": trust, "memory": memory, "digests": digests}


def _restore(run: dict, memory: Path) -> tuple[cv.RestoreInfo | None, str]:
    """A restore in a fresh manager, with the ledger as the killed run left it (a
    restore raises the floor: each test starts from the killed run's own)."""
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    tier = cv.MemoryTier(path=memory, keep=1, durable_every=5)
    ledger = memory.with_name(memory.name + ".ledger.db")
    shutil.copyfile(run["trust"]["ledger"], ledger)
    audit = memory.with_name(memory.name + ".audit.jsonl")
    shutil.copyfile(run["trust"]["audit_log"], audit)
    trust = {**run["trust"], "ledger": str(ledger), "audit_log": str(audit)}
    with cv.CheckpointManager(
        run["root"] / "store", run_id="mem", **trust, memory_tier=tier
    ) as mgr:
        info = mgr.restore({"model": model, "optim": optimizer})
    import hashlib

    return info, hashlib.sha256(model.weight.detach().numpy().tobytes()).hexdigest()


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name.split(".")[0].removeprefix("step-")) for p in directory.glob("step-*"))


def _copy_of(run: dict, name: str) -> Path:
    """A scratch copy of the killed run's memory tier (each test changes its own)."""
    target = run["root"] / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(run["memory"], target, symlinks=True)
    return target


def test_a_restarted_process_restores_the_newest_save_from_memory(killed: dict):
    assert _steps(killed["root"] / "store") == [5, 10]  # every 5th save went to the store
    assert _steps(killed["memory"]) == [12, 13]  # keep=1, and retention's verified fallback
    info, digest = _restore(killed, _copy_of(killed, "m1"))
    assert info is not None and info.step == 13 and info.source == "memory"
    assert digest == killed["digests"]["13"]


def test_an_emptied_memory_tier_falls_back_to_the_store(killed: dict):
    memory = _copy_of(killed, "m2")
    for child in memory.iterdir():
        shutil.rmtree(child) if child.is_dir() else child.unlink()
    info, digest = _restore(killed, memory)
    assert info is not None and info.step == 10 and info.source == "store"
    assert digest == killed["digests"]["10"]


def test_a_changed_byte_in_memory_is_refused_and_the_next_copy_used(killed: dict):
    memory = _copy_of(killed, "m3")
    newest = sorted(memory.glob("step-*"))[-1]
    assert newest.name.startswith("step-000000000013.")
    [tensor_file] = newest.glob("*.safetensors*")  # ".enc" when encrypted
    data = bytearray(tensor_file.read_bytes())
    data[-1] ^= 0x01
    tensor_file.write_bytes(bytes(data))
    info, digest = _restore(killed, memory)
    assert info is not None and info.step == 12 and info.source == "memory"
    assert digest == killed["digests"]["12"]
    assert [s.step for s in info.skipped] == [13]
    for older in sorted(memory.glob("step-*"))[:-1]:  # and without the memory fallback
        shutil.rmtree(older)
    info, digest = _restore(killed, memory)
    assert info is not None and info.step == 10 and info.source == "store"
    assert digest == killed["digests"]["10"]


def test_a_full_memory_tier_skips_its_copies_and_training_goes_on(tmp_path: Path):
    model = torch.nn.Linear(512, 512)  # 1 MiB of weights: more than the tier holds
    with mounted_tmpfs(tmp_path / "small", "size=1m,mode=0700") as memory:
        tier = cv.MemoryTier(path=memory, keep=1, durable_every=2)
        catalog = tmp_path / "catalog.sqlite3"
        manager = cv.CheckpointManager(
            tmp_path / "store", run_id="full", memory_tier=tier, catalog=catalog
        )
        with manager as mgr, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            handles = [mgr.save(step, {"model": model}, blocking=True) for step in (1, 2, 3, 4)]
        assert [h.skipped for h in handles] == [True, False, True, False]
        skipped = mgr.metrics_registry.get_sample_value(
            "ckptvault_memory_saves_skipped_total", {"run_id": "full"}
        )
        assert skipped == 4
        assert sum("no room" in str(w.message) for w in caught) == 4
        assert _steps(memory) == []
    assert _steps(tmp_path / "store") == [2, 4]
    with sqlite3.connect(catalog) as db:  # each skip is an attempt in the catalog
        query = "SELECT step, error_type FROM saves WHERE ok = 0 ORDER BY step"
        rows = db.execute(query).fetchall()
    assert rows == [(step, "MemorySkipped") for step in (1, 2, 3, 4)]


def test_async_saves_go_to_memory_and_every_second_to_the_store(tmp_path: Path):
    model = torch.nn.Linear(32, 32)
    tier = cv.MemoryTier(path=tmp_path / "memory", keep=2, durable_every=2)
    with cv.CheckpointManager(
        tmp_path / "store", run_id="a", async_save=True, memory_tier=tier
    ) as mgr:
        for step in range(1, 6):
            with torch.no_grad():
                model.weight.fill_(float(step))
            mgr.save(step, {"model": model})  # staged: the next fill_ cannot reach it
        mgr.wait()
        sample = mgr.metrics_registry.get_sample_value
        assert sample("ckptvault_memory_saves_total", {"run_id": "a"}) == 5
        assert sample("ckptvault_saves_total", {"run_id": "a"}) == 2  # the durable ones
        assert sample("ckptvault_memory_last_save_age_seconds", {"run_id": "a"}) < 60
    assert _steps(tmp_path / "store") == [2, 4]
    assert _steps(tmp_path / "memory") == [4, 5]  # keep=2 (the fallback one of them)
    fresh = torch.nn.Linear(32, 32)
    with cv.CheckpointManager(tmp_path / "store", run_id="a", memory_tier=tier) as mgr:
        info = mgr.restore({"model": fresh})
    assert info is not None and (info.step, info.source) == (5, "memory")
    assert torch.equal(fresh.weight, torch.full((32, 32), 5.0))


def test_a_durable_save_and_a_preempted_job_s_final_save_reach_the_store(tmp_path: Path):
    import signal

    model = torch.nn.Linear(8, 8)
    tier = cv.MemoryTier(path=tmp_path / "memory", keep=1, durable_every=100)
    with cv.CheckpointManager(
        tmp_path / "store", run_id="d", memory_tier=tier, save_on_signal=(signal.SIGUSR1,)
    ) as mgr:
        mgr.save(1, {"model": model})
        mgr.save(2, {"model": model}, durable=True)
        mgr.save(3, {"model": model})
        os.kill(os.getpid(), signal.SIGUSR1)  # the scheduler's notice
        with pytest.raises(cv.Preempted):
            mgr.save(4, {"model": model})
    assert _steps(tmp_path / "store") == [2, 4]  # the asked-for one and the final one


def test_the_memory_directory_must_be_private(tmp_path: Path):
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o777)
    os.chmod(open_dir, 0o777)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").mkdir()
    for path in (open_dir, link):
        with pytest.raises(UsageError, match="memory tier's directory"):
            cv.CheckpointManager(
                tmp_path / "store", run_id="r", memory_tier=cv.MemoryTier(path=path)
            )


def test_the_readme_example_runs_as_written(tmp_path: Path):
    """The documented block, in a process of its own, with the default directory under
    /dev/shm (for a node name of this test's own, removed after)."""
    from support.readme_runs import readme_block

    node = f"readme-{os.getpid()}"
    script = (
        "import torch\nimport ckptvault as cv\n"
        "state, step = {'model': torch.nn.Linear(4, 4)}, 1\n"
        + readme_block("### A memory tier: recovery from RAM")
        + "print(info.source, info.step)\n"
    )
    try:
        result = subprocess.run(
            [sys.executable, "-c", script],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={**os.environ, "CKPTVAULT_NODE": node},
        )
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.split() == ["memory", "1"]
    finally:
        shutil.rmtree(Path(f"/dev/shm/ckptvault-{os.geteuid()}/run42/{node}"), ignore_errors=True)


def test_ckptvault_ls_lists_the_memory_tier_through_a_pipe(killed: dict):
    memory = _copy_of(killed, "m4")
    result = subprocess.run(
        [sys.executable, "-m", "ckptvault", "ls", "--tier", "memory", "--memory-path", str(memory)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["step", "generation"]
    assert [line.split()[0] for line in lines[1:]] == ["13", "12"]  # one line each, unwrapped
    os.chmod(memory, 0o777)  # a tier others can write is refused, not listed
    refused = subprocess.run(
        [sys.executable, "-m", "ckptvault", "ls", "--tier", "memory", "--memory-path", str(memory)],
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and "writable by group or others" in refused.stderr


def test_two_ranks_on_one_node_share_its_memory_tier(tmp_path: Path):
    from support.multirank import launch

    store = tmp_path / "store"
    codes, reports = launch("memory_save", store, 2, tmp_path / "save")
    assert codes == [0, 0], [r["log"][-2000:] for r in reports]
    assert _steps(store) == [2] and _steps(Path(f"{store}-memory")) == [2, 3]
    codes, reports = launch("memory_restore", store, 2, tmp_path / "restore")
    assert codes == [0, 0], [r["log"][-2000:] for r in reports]
    for report in reports:  # each rank's shard of step 3, from memory
        assert (report["step"], report["source"], report["weight_exact"]) == (3, "memory", True)
    shutil.rmtree(f"{store}-memory")  # the node's memory lost: the store's step 2
    codes, reports = launch("memory_restore", store, 2, tmp_path / "fallback")
    assert codes == [0, 0], [r["log"][-2000:] for r in reports]
    for report in reports:
        assert (report["step"], report["source"], report["weight_exact"]) == (2, "store", True)


@pytest.mark.parametrize("trust", ["plain", "signed+encrypted", "plain, async saves"])
def test_four_ranks_on_two_nodes_survive_the_loss_of_a_node(
    tmp_path: Path, trust: str, monkeypatch: pytest.MonkeyPatch
):
    """4 gloo ranks as 2 nodes (CKPTVAULT_NODE), memory every step, the store every
    5th, every rank SIGKILLed at step 13; signed and encrypted with a ledger too
    (each restore starts from the ledger the save left: a restore raises the floor)."""
    from support.multirank import launch

    store = tmp_path / "store"
    ledger, audit = tmp_path / "ledger.db", tmp_path / "audit.log"
    if trust == "plain, async saves":
        monkeypatch.setenv("TEST_ASYNC", "1")
        trust = "plain"
    if trust != "plain":
        generate_keypair(tmp_path / "key.pem", tmp_path / "key.pub")
        monkeypatch.setenv("TEST_KEYSTORE", str(tmp_path / "keys"))
        monkeypatch.setenv("TEST_SIGNING_KEY", str(tmp_path / "key.pem"))
        monkeypatch.setenv("TEST_TRUSTED_KEY", str(tmp_path / "key.pub"))
        monkeypatch.setenv("TEST_LEDGER", str(ledger))
        monkeypatch.setenv("TEST_AUDIT_LOG", str(audit))
    node_a, node_b = Path(f"{store}-memory-A"), Path(f"{store}-memory-B")
    leftover = node_b / ".staging" / "20260101T000000000000Z-0badc0de"  # a crash's
    leftover.mkdir(parents=True)
    node_b.chmod(0o700)
    (leftover / "r00002-000.safetensors").write_bytes(b"half a file")
    codes, reports = launch("nodes_save", store, 4, tmp_path / "save")
    assert codes == [-9] * 4, [r["log"][-2000:] for r in reports]
    assert _steps(store) == [5, 10]
    assert _steps(node_a) == _steps(node_b) == [12, 13]  # rank 0's node, and its peer
    assert not leftover.exists()  # node B's first rank swept its staging
    saved_a, saved_b = _copy_of({"memory": node_a, "root": tmp_path}, "a0"), None
    saved_b = _copy_of({"memory": node_b, "root": tmp_path}, "b0")

    def restore(name: str) -> list[tuple[int, str, bool]]:
        if trust != "plain":  # this restore's own copy of the ledger the save left
            for saved, variable in ((ledger, "TEST_LEDGER"), (audit, "TEST_AUDIT_LOG")):
                own = tmp_path / f"{name}-{saved.name}"
                shutil.copyfile(saved, own)
                monkeypatch.setenv(variable, str(own))
        codes, reports = launch("nodes_restore", store, 4, tmp_path / name)
        assert codes == [0] * 4, [r["log"][-2000:] for r in reports]
        return [(r["step"], r["source"], r["weight_exact"]) for r in reports]

    def reset(a: bool, b: bool) -> None:
        for live, saved, keep in ((node_a, saved_a, a), (node_b, saved_b, b)):
            shutil.rmtree(live, ignore_errors=True)
            if keep:
                shutil.copytree(saved, live, symlinks=True)

    reset(a=True, b=False)  # node B is lost: its ranks fetch step 13 from node A
    assert restore("lose-b") == [(13, "memory", True)] * 2 + [(13, "peer", True)] * 2
    reset(a=False, b=True)  # node A is lost: from B's copy
    assert restore("lose-a") == [(13, "peer", True)] * 2 + [(13, "memory", True)] * 2
    reset(a=True, b=False)  # B lost, and one byte of A's copy of step 13 changed
    newest = sorted(node_a.glob("step-*"))[-1]
    [tensors] = sorted(newest.glob("*.safetensors*"))[:1]  # ".enc" when encrypted
    tensors.chmod(0o644)
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 1
    tensors.write_bytes(bytes(data))
    results = restore("corrupt")
    assert [r[0] for r in results] == [12] * 4 and all(r[2] for r in results)
    reset(a=False, b=False)  # both nodes lost: the store's step 10
    assert restore("lose-both") == [(10, "store", True)] * 4


def test_ckptvault_status_shows_this_node_s_memory_tier(killed: dict):
    memory = _copy_of(killed, "m5")
    command = [sys.executable, "-m", "ckptvault", "status", str(killed["root"] / "store")]
    command += ["--memory-path", str(memory), "--ledger", killed["trust"]["ledger"]]
    piped = subprocess.run(command, capture_output=True, text=True)
    [line] = [line for line in piped.stdout.splitlines() if line.startswith("memory")]
    assert line.split()[:5] == ["memory", "(this", "node)", "step", "13,"], piped.stdout
    as_json = subprocess.run([*command, "--json"], capture_output=True, text=True)
    memory_report = json.loads(as_json.stdout)["memory"]
    assert memory_report["step"] == 13 and memory_report["age_s"] < 3600


def test_the_supervisor_records_what_the_memory_tier_holds_at_each_restart(tmp_path: Path):
    """A job that saves 3 steps into its memory tier and fails, then succeeds: the
    supervisor's record of the failed attempt says step 3 is in memory here."""
    memory, log = tmp_path / "memory", tmp_path / "attempts.jsonl"
    job = (
        "import os, sys, torch, ckptvault as cv\n"
        "if os.environ['CKPTVAULT_ATTEMPT'] == '2': sys.exit(0)\n"
        f"tier = cv.MemoryTier(path={str(memory)!r}, keep=1, durable_every=5)\n"
        f"with cv.CheckpointManager({str(tmp_path / 'store')!r}, run_id='sup', memory_tier=tier,"
        " catalog=False) as mgr:\n"
        "    for step in (1, 2, 3): mgr.save(step, {'w': torch.ones(4)})\n"
        "sys.exit(1)\n"
    )
    command = [sys.executable, "-m", "ckptvault", "supervise", "--backoff", "0,0.05"]
    command += ["--no-catalog", "--log", str(log), "--memory-path", str(memory)]
    result = subprocess.run([*command, "--", sys.executable, "-c", job], capture_output=True)
    assert result.returncode == 0, result.stderr.decode()[-2000:]
    attempts = [json.loads(line) for line in log.read_text().splitlines()]
    assert [a.get("memory_step") for a in attempts if a["event"] == "attempt"] == [3, 3]


def test_two_machines_under_one_node_name_are_refused(tmp_path: Path):
    from support.multirank import launch

    codes, reports = launch("one_name_two_machines", tmp_path / "store", 4, tmp_path / "run")
    assert codes == [0] * 4, [r["log"][-2000:] for r in reports]
    for report in reports:  # every rank alike, before anything is saved
        assert "two machines use one node name" in report["error"]
    assert not list(Path(f"{tmp_path / 'store'}-memory-0").glob(".node-check-*"))


def test_memory_tier_settings_are_checked():
    with pytest.raises(UsageError, match="durable_every"):
        cv.MemoryTier(durable_every=0)
    with pytest.raises(UsageError, match="keep"):
        cv.MemoryTier(keep=0)


def test_a_peer_that_cannot_write_its_copy_costs_a_copy_not_the_save(tmp_path: Path):
    """Node B's first rank fails to write what it receives (a full tmpfs): the
    transfer still ends together on every rank (no rank waits for the collective
    timeout), the saves stand on node A, and B publishes nothing."""
    from support.multirank import launch

    store = tmp_path / "store"
    codes, reports = launch("nodes_peer_cannot_write", store, 4, tmp_path / "out")
    assert codes == [0] * 4, [r["log"][-2000:] for r in reports]
    assert max(r["seconds"] for r in reports) < 15  # the collective timeout is 20 s
    assert _steps(Path(f"{store}-memory-A")) == [1, 2]
    node_b = Path(f"{store}-memory-B")
    assert _steps(node_b) == [] and not any((node_b / ".staging").iterdir())


def test_a_peer_publishes_only_a_copy_that_verifies(tmp_path: Path):
    """A byte of step 2 on node A changes while rank 0 copies it to node B: B refuses
    that copy before it is visible (a warning, the save stands) and keeps what it had."""
    from support.multirank import launch

    store = tmp_path / "store"
    codes, reports = launch("nodes_copy_changed", store, 4, tmp_path / "out")
    assert codes == [0] * 4, [r["log"][-2000:] for r in reports]
    assert "does not verify" in reports[0]["log"]
    assert _steps(Path(f"{store}-memory-A")) == [1, 2]
    node_b = Path(f"{store}-memory-B")
    assert _steps(node_b) == [1] and not any((node_b / ".staging").iterdir())


def test_what_is_planted_in_a_node_s_memory_is_not_offered_and_blocks_no_one(tmp_path: Path):
    """Node A's memory holds a FIFO inside its newest generation and 70 planted empty
    generations (more than a node may announce): with node B lost, every rank still
    restores the same verified step, without waiting on the FIFO or the timeout."""
    from support.multirank import launch

    store = tmp_path / "store"
    codes, reports = launch("nodes_save_two", store, 4, tmp_path / "save")
    assert codes == [0] * 4, [r["log"][-2000:] for r in reports]
    node_a = Path(f"{store}-memory-A")
    shutil.rmtree(f"{store}-memory-B")
    [newest] = sorted(node_a.glob("step-000000000002.*"))
    os.mkfifo(newest / "zz-fifo")
    for n in range(70):
        (
            node_a / f"step-000000000000.20260101T00{n // 60:02d}{n % 60:02d}000000Z-0000aa{n:02x}"
        ).mkdir()
    codes, reports = launch("nodes_restore_two", store, 4, tmp_path / "restore", timeout=60)
    assert codes == [0] * 4, [r["log"][-2000:] for r in reports]
    assert len({r["step"] for r in reports}) == 1 and all(r["weight_exact"] for r in reports)
    assert max(r["seconds"] for r in reports) < 15  # the collective timeout is 20 s


def test_a_job_that_restarts_from_memory_still_reaches_the_store(tmp_path: Path):
    """Three attempts of four saves each, every one restored from memory, with
    durable_every=5: counting saves per attempt, none would ever reach the store (a
    crash loop would live in memory alone, lost with the node). The first save after
    a restore from memory goes to the store."""
    tier = cv.MemoryTier(path=tmp_path / "memory", keep=1, durable_every=5)
    model = torch.nn.Linear(4, 4)
    step = 0
    for _attempt in range(3):
        with cv.CheckpointManager(tmp_path / "store", run_id="loop", memory_tier=tier) as mgr:
            info = mgr.restore({"model": model})
            assert info is None or info.source == "memory"
            for _ in range(4):
                step += 1
                mgr.save(step, {"model": model})
    assert _steps(tmp_path / "store") == [5, 9]
