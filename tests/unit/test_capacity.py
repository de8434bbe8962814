"""A full disk: saves check free space first, and a save that runs out anyway
removes its partial attempt. Either way every published generation stays intact.

Runs on a real, size-limited tmpfs that the test mounts; mounting needs root (or
CAP_SYS_ADMIN), so elsewhere these tests are skipped.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import StorageFullError
from ckptvault.storage.posix.store import PosixStore
from support.common import mounted_tmpfs, run_cli

MiB = 1024 * 1024


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "small", "size=24m,nr_inodes=4096") as mount_point:
        yield mount_point


def weights(mib: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(mib * MiB // 4, generator=generator)}


def assert_every_generation_verifies(store: Path, steps: list[int]) -> None:
    result = run_cli("verify", str(store), "--all")
    assert result.returncode == 0, result.stdout + result.stderr
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert [g.step for g in mgr.generations()] == steps
    assert os.listdir(store / ".staging") == []


def test_a_save_that_cannot_fit_is_refused_before_writing(small_fs: Path):
    store = small_fs / "store"
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, weights(6, 1))
        mgr.save(2, weights(6, 2))
        free_before = os.statvfs(store).f_bavail * os.statvfs(store).f_frsize
        with pytest.raises(StorageFullError) as refused:
            mgr.save(3, weights(14, 3))
        message = str(refused.value)
        assert str(store) in message and "bytes" in message and "retention" in message
        assert f"{free_before:,}" in message  # the bytes free, as the check saw them
        assert os.statvfs(store).f_bavail * os.statvfs(store).f_frsize == free_before
        mgr.save(3, weights(2, 3))  # a save that fits still works
    assert_every_generation_verifies(store, [3, 2, 1])


def test_running_out_mid_save_removes_the_attempt(small_fs: Path, monkeypatch: pytest.MonkeyPatch):
    store = small_fs / "store"
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, weights(8, 1))
    # The free-space estimate can be wrong (another writer, quota): skip it, so the
    # save really runs into ENOSPC while writing.
    monkeypatch.setattr(PosixStore, "check_capacity", lambda self, nbytes, nfiles: None)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        with pytest.raises(StorageFullError, match="full"):
            mgr.save(2, weights(20, 2))
        assert os.listdir(store / ".staging") == []  # the partial attempt is gone
        restored = {"w": torch.zeros(8 * MiB // 4)}
        assert mgr.restore(restored).step == 1
        assert torch.equal(restored["w"], weights(8, 1)["w"])
    assert_every_generation_verifies(store, [1])
