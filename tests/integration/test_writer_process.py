"""``async_mode="process"``: asynchronous saves written by a long-lived writer process.

Real processes throughout: the writer is a child interpreter staged through files
under /dev/shm; deaths are real SIGKILLs, of the writer and of the trainer.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import SaveFailedError, StorageFullError, UsageError
from ckptvault.trust.keystores import LocalKeyStore
from ckptvault.trust.signing import generate_keypair
from support.common import mounted_tmpfs
from support.doc_pages import python_block_after
from support.multirank import launch

SHM = Path("/dev/shm")


def training_state(width: int = 128, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, 4))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(3, width)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer, "meta": {"tokens": 7}}


def fresh_like(width: int = 128) -> dict:
    return training_state(width, seed=1)


def writer_pids() -> list[int]:
    """This process's writer processes, found as an operator would (ps)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"ckptvault.writer_main" in cmdline:
            pids.append(int(entry.name))
    return pids


def slot_files(pid: int) -> list[Path]:
    return sorted(SHM.glob(f"ckptvault-stage-{pid}-*"))


def test_signed_encrypted_saves_resume_exactly_and_the_trainer_keeps_the_records(tmp_path):
    key = tmp_path / "keys"
    generate_keypair(key / "k.pem", key / "k.pub")
    trust = {
        "signing_key": key / "k.pem",
        "trusted_keys": [key / "k.pub"],
        "keystore": LocalKeyStore(tmp_path / "kek"),
        "ledger": tmp_path / "ledger.db",
    }
    state = training_state()
    store = tmp_path / "store"
    with cv.CheckpointManager(
        store, run_id="r", async_save=True, async_mode="process", **trust
    ) as mgr:
        for step in (1, 2, 3):
            with torch.no_grad():
                state["model"][0].weight.add_(step)
            state["meta"]["tokens"] = step * 10
            handle = mgr.save(step, state)
            with torch.no_grad():  # training moves on the moment save returns
                state["model"][0].weight.add_(1000.0)
                state["model"][0].weight.sub_(1000.0)
        mgr.wait()
        assert handle.result().step == 3
        assert mgr.stats.saves_completed == 3
        assert len(writer_pids()) == 1  # one long-lived process served all three
        assert slot_files(os.getpid())
        expected = {k: v.clone() for k, v in state["model"].state_dict().items()}
    assert writer_pids() == [] and slot_files(os.getpid()) == []  # close() stops and cleans
    target = fresh_like()
    with cv.CheckpointManager(store, run_id="r", **trust) as mgr:
        info = mgr.restore(target)
        generations = mgr.generations()
    assert info.step == 3 and info.signer is not None
    assert target["meta"] == {"tokens": 30}
    for name, value in expected.items():
        assert torch.equal(target["model"].state_dict()[name], value)
    # Each generation names the one before (the parent chain crosses the process).
    manifests = [
        __import__("json").loads((Path(g.path) / "manifest.json").read_text())
        for g in reversed(generations)
    ]
    assert [m.get("parent") for m in manifests] == [
        None,
        generations[2].generation_id,
        generations[1].generation_id,
    ]
    assert "encryption" in manifests[0]


def test_a_killed_writer_publishes_nothing_and_the_next_save_starts_a_new_one(tmp_path):
    store = tmp_path / "store"
    small, big = training_state(), {"w": torch.randn(64, 1024, 1024)}  # 256 MB: long enough
    with cv.CheckpointManager(store, run_id="r", async_save=True, async_mode="process") as mgr:
        mgr.save(1, small).result()
        [first] = writer_pids()
        mgr.save(2, big)
        staging = store / ".staging"
        deadline = time.monotonic() + 60
        while not any(staging.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.005)  # the writer began step 2's attempt
        os.kill(first, signal.SIGKILL)
        with pytest.raises(SaveFailedError, match=r"writer process .* died \(killed by signal 9\)"):
            mgr.wait()
        assert [g.step for g in mgr.generations()] == [1]
        mgr.save(3, small).result()
        [second] = writer_pids()
        assert second != first
        assert [g.step for g in mgr.generations()] == [3, 1]
        assert list(staging.iterdir()) == []  # the dead writer's attempt is gone
    target = fresh_like()
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert mgr.restore(target).step == 3


def test_an_error_in_the_writer_is_raised_typed_at_the_next_save(tmp_path):
    with mounted_tmpfs(tmp_path / "small", "size=8m") as mount:
        store = mount / "store"
        with cv.CheckpointManager(store, run_id="r", async_save=True, async_mode="process") as mgr:
            mgr.save(1, training_state()).result()
            failing = mgr.save(2, {"w": torch.zeros(4, 1024, 1024)})  # 16 MB on 8 MB
            # Known failed before the next save is asked for (else, still in flight, it
            # is raised at a later one): waiting for it does not report it.
            assert isinstance(failing.exception(timeout=120), StorageFullError)
            with pytest.raises(StorageFullError, match="free"):
                mgr.save(3, training_state())
            assert [g.step for g in mgr.generations()] == [1]
            mgr.save(4, training_state()).result()  # the writer lives on
            assert [g.step for g in mgr.generations()] == [4, 1]


def test_a_killed_trainer_leaves_no_generation_no_writer_and_no_shared_memory(tmp_path):
    store = tmp_path / "store"
    script = textwrap.dedent(
        f"""
        import os, signal, sys, time, torch
        import ckptvault as cv
        from test_writer_process import writer_pids
        mgr = cv.CheckpointManager({str(store)!r}, run_id="r", async_save=True,
                                   async_mode="process")
        mgr.save(1, {{"w": torch.ones(8)}}).result()
        mgr.save(2, {{"w": torch.randn(64, 1024, 1024)}})
        while not os.listdir({str(store / ".staging")!r}):
            time.sleep(0.005)
        print(os.getpid(), writer_pids()[0], flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{Path(__file__).parent}{os.pathsep}{os.environ['PYTHONPATH']}",
    }
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    trainer, writer = (int(pid) for pid in proc.stdout.split())
    deadline = time.monotonic() + 20
    while (_alive(writer) or slot_files(trainer)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(writer) and slot_files(trainer) == []
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert [g.step for g in mgr.generations()] == [1]  # step 2 was never published
        target = {"w": torch.zeros(8)}
        assert mgr.restore(target).step == 1


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_what_the_writer_process_cannot_serve_is_refused_up_front(tmp_path):
    with pytest.raises(UsageError, match="give 'thread'"):
        cv.CheckpointManager(tmp_path / "a", run_id="r", async_mode="fork")
    with pytest.raises(UsageError, match="memory tier"):
        cv.CheckpointManager(
            tmp_path / "b",
            run_id="r",
            async_mode="process",
            memory_tier=cv.MemoryTier(path=tmp_path / "mem"),
        )


# -- many ranks: the writers save collectively in a group of their own ---------------------


def ok(codes: list[int], reports: list[dict]) -> list[dict]:
    assert codes == [0] * len(codes), [r.get("log", "")[-3000:] for r in reports]
    return reports


def test_two_ranks_of_sharded_state_save_through_writer_processes_and_restore(tmp_path):
    store = tmp_path / "store"
    saved = ok(*launch("save_process", store, 2, tmp_path / "save"))
    restored = ok(*launch("restore", store, 2, tmp_path / "restore"))
    for before, after in zip(saved, restored, strict=True):
        assert after["step"] == 2 and after["weight_exact"]  # a DTensor, sharded by rows
        assert after["bias"] == [2.0, 2.0, 2.0] and after["meta"] == {"tokens_seen": 2000}
        assert after["draw"] == before["after_save_draw"]  # each rank's own RNG


def test_a_rank_whose_writer_dies_fails_the_save_on_every_rank_then_all_start_anew(tmp_path):
    store = tmp_path / "store"
    reports = ok(*launch("process_writer_killed", store, 2, tmp_path / "out"))
    for report in reports:
        assert report["step2"] != "published", report
        assert report["new_writer"] and report["steps"] == [3, 1]
    assert "died (killed by signal 9)" in reports[1]["step2"][1]
    restored = ok(*launch("restore", store, 2, tmp_path / "restore"))
    assert all(r["step"] == 3 and r["weight_exact"] for r in restored)


def test_the_readme_block_runs_as_written(tmp_path, monkeypatch):
    """The docs' block under "A writer process: `async_mode="process"`", as written."""
    block = python_block_after('A writer process: `async_mode="process"`')
    monkeypatch.chdir(tmp_path)
    scope: dict = {"cv": cv}
    exec(block, scope)  # the documented example
    with scope["mgr"] as mgr:
        mgr.save(1, {"w": torch.arange(4.0)})
        mgr.wait()
        target = {"w": torch.zeros(4)}
        assert mgr.restore(target).step == 1 and target["w"].tolist() == [0.0, 1.0, 2.0, 3.0]
