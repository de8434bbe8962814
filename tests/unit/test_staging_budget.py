"""Asynchronous staging is refused, with numbers and what to do, before it would
take more host memory than there is: ``prepare()`` and the first asynchronous save
raise ``HostMemoryError`` and leave nothing staged and the store as it was.

The host is made small for real: ``/proc/meminfo`` and the memory cgroup files are
read from paths the tests point at small fake ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import CheckpointError, HostMemoryError
from ckptvault.io import memory_available
from ckptvault.io.memory_available import Available, available_memory
from ckptvault.saving.staging_budget import StagingBudget, check_staging_fits

MiB = 2**20


@pytest.fixture
def small_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A host whose MemAvailable is whatever the test writes (no cgroup limit)."""
    meminfo = tmp_path / "meminfo"
    monkeypatch.setattr(memory_available, "MEMINFO", meminfo)
    monkeypatch.setattr(memory_available, "SELF_CGROUP", tmp_path / "no-cgroup")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)

    def set_available(nbytes: int) -> None:
        meminfo.write_text(
            f"MemTotal:  {64 * MiB // 1024} kB\nMemAvailable:  {nbytes // 1024} kB\n"
        )

    return set_available


def _store_files(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size) for p in root.rglob("*"))


def test_staging_that_does_not_fit_is_refused_before_anything_is_staged(tmp_path, small_host):
    small_host(6 * MiB)
    state = {"w": torch.ones(MiB, dtype=torch.float32)}  # 4 MiB: one slot fits, two do not
    store = tmp_path / "store"
    with cv.CheckpointManager(store, run_id="r", async_save=True, max_in_flight=2) as mgr:
        mgr.save(1, state, blocking=True)  # synchronous saves stage nothing: unaffected
        before = _store_files(store)
        with pytest.raises(HostMemoryError) as refused:
            mgr.prepare(state)
        error = refused.value
        assert isinstance(error, CheckpointError)
        assert error.reason == "host-memory"
        assert (error.needed, error.available) == (8 * MiB, 6 * MiB)
        message = str(error)
        assert "prepare() refused" in message and "8.0 MiB" in message and "6.0 MiB" in message
        assert "MemAvailable" in message and "max_in_flight" in message
        assert "async_save=False" in message
        with pytest.raises(HostMemoryError, match="the first asynchronous save refused"):
            mgr.save(2, state)
        assert mgr.stats.staging_allocations == 0
        assert _store_files(store) == before
        assert [g.step for g in mgr.generations()] == [1]

    # What the message says to do works: one save in flight fits.
    with cv.CheckpointManager(store, run_id="r", async_save=True, max_in_flight=1) as mgr:
        mgr.save(2, state).result()
        assert [g.step for g in mgr.generations()] == [2, 1]


def test_every_rank_of_the_node_is_counted(tmp_path, small_host, monkeypatch):
    small_host(10 * MiB)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    state = {"w": torch.ones(MiB, dtype=torch.float32)}
    with (
        cv.CheckpointManager(tmp_path / "s", run_id="r", async_save=True) as mgr,
        pytest.raises(HostMemoryError, match=r"x 4 ranks on this node = 16\.0 MiB"),
    ):
        mgr.save(1, state)


def test_process_mode_refuses_before_starting_its_writer(tmp_path, small_host):
    small_host(2 * MiB)
    state = {"w": torch.ones(MiB, dtype=torch.float32)}
    with cv.CheckpointManager(tmp_path / "s", run_id="r", async_mode="process") as mgr:
        with pytest.raises(HostMemoryError, match="prepare\\(\\) refused"):
            mgr.prepare(state)
        assert mgr.stats.staging_allocations == 0


def test_a_full_shared_memory_filesystem_is_named():
    budget = StagingBudget(
        per_slot=8 * MiB,
        slots=2,
        ranks=1,
        mode="process",
        memory=Available(2**30, "MemAvailable in /proc/meminfo"),
        shm_free=10 * MiB,
    )
    with pytest.raises(HostMemoryError) as refused:
        check_staging_fits(budget, "prepare()")
    assert refused.value.reason == "shared-memory"
    assert "/dev/shm" in str(refused.value) and "--shm-size" in str(refused.value)
    thread = StagingBudget(8 * MiB, 2, 1, "thread", budget.memory, None)
    check_staging_fits(thread, "prepare()")  # in thread mode /dev/shm plays no part


def _cgroup(directory: Path, limit: str, usage: int, stat: str, v1: bool = False) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    names = (
        ("memory.limit_in_bytes", "memory.usage_in_bytes")
        if v1
        else ("memory.max", "memory.current")
    )
    (directory / names[0]).write_text(limit + "\n")
    (directory / names[1]).write_text(f"{usage}\n")
    (directory / "memory.stat").write_text(stat)


def test_the_tightest_memory_cgroup_above_the_process_decides(tmp_path, small_host, monkeypatch):
    small_host(2**30)
    root, me = tmp_path / "cgroup", tmp_path / "self-cgroup"
    monkeypatch.setattr(memory_available, "CGROUP_ROOT", root)
    monkeypatch.setattr(memory_available, "SELF_CGROUP", me)
    # cgroup v2: the job has the limit, its step none; reclaimable page cache is free.
    me.write_text("0::/job/step\n")
    _cgroup(root / "job", str(100 * MiB), 90 * MiB, f"anon 1\ninactive_file {5 * MiB}\n")
    _cgroup(root / "job" / "step", "max", 80 * MiB, "")
    found = available_memory()
    assert found is not None and found.bytes == 15 * MiB
    assert "memory cgroup /job" in found.limit
    # cgroup v1: a huge number is no limit; MemAvailable is then the smaller.
    me.write_text("4:memory:/slurm/job1\n1:cpu:/\n")
    _cgroup(root / "memory" / "slurm" / "job1", "9223372036854771712", MiB, "", v1=True)
    _cgroup(
        root / "memory" / "slurm", str(512 * MiB), 500 * MiB, "total_inactive_file 0\n", v1=True
    )
    found = available_memory()
    assert found is not None and found.bytes == 12 * MiB and "/slurm" in found.limit
    # Unreadable or odd files count as no limit, never as an error.
    (root / "memory" / "slurm" / "memory.usage_in_bytes").write_text("lots\n")
    found = available_memory()
    assert found is not None and found.bytes == 2**30 and "MemAvailable" in found.limit
