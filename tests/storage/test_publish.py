"""Atomic, durable publish on a POSIX filesystem, and one writer per store."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import StorageFullError, StoreLockedError
from support.common import REPO, mounted_tmpfs


def test_publish_protocol_order(store: Path, monkeypatch: pytest.MonkeyPatch):
    """Files are fsync'd, then the manifest, then the staging dir; rename; then the store dir."""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename, real_open = os.fsync, os.rename, os.open
    fd_paths: dict[int, str] = {}

    def tracking_open(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        fd_paths[fd] = os.fspath(path)
        return fd

    def tracking_fsync(fd):
        events.append(("fsync", fd_paths.get(fd, "?")))
        return real_fsync(fd)

    def tracking_rename(src, dst, **dir_fds):
        events.append(("rename", f"{src} -> {dst}"))
        return real_rename(src, dst, **dir_fds)

    # The store's modules all call through the one os module: patch it, see them all.
    monkeypatch.setattr(os, "open", tracking_open)
    monkeypatch.setattr(os, "fsync", tracking_fsync)
    monkeypatch.setattr(os, "rename", tracking_rename)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.save(1, {"model": torch.nn.Linear(4, 4)}).result()
    monkeypatch.undo()
    kinds = [(kind, Path(target.split(" -> ")[0]).name) for kind, target in events]
    rename_at = [i for i, (kind, _) in enumerate(kinds) if kind == "rename"]
    assert len(rename_at) == 1
    before, after = kinds[: rename_at[0]], kinds[rename_at[0] + 1 :]
    synced_before = [name for _, name in before]
    assert synced_before[-2:] == ["manifest.json", info.generation_id]  # manifest, then its dir
    assert any(name.endswith(".safetensors") for name in synced_before[:-2])
    assert ("fsync", store.name) in after  # the store directory, after the rename
    # Renamed relative to directory descriptors: .staging/<id> -> <store>/step-...
    assert events[rename_at[0]][1] == f"{info.generation_id} -> {Path(info.path).name}"


def test_staging_leftovers_are_ignored_then_removed(store: Path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"x": torch.ones(2)})
    leftover = store / ".staging" / "20260101T000000000000Z-deadbeef"
    leftover.mkdir(parents=True)
    (leftover / "r00000-000.safetensors").write_bytes(b"half a file")
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert [g.step for g in mgr.generations()] == [1]
        assert mgr.restore({"x": torch.zeros(2)}).step == 1
        assert leftover.exists()  # restore never deletes anything
        mgr.save(2, {"x": torch.ones(2)})
        assert not leftover.exists()
        assert os.listdir(store / ".staging") == []


def test_published_generation_is_read_only_and_names_are_unique(store: Path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        a = mgr.save(5, {"x": torch.ones(2)}).result()
        b = mgr.save(5, {"x": torch.full((2,), 2.0)}).result()
        assert a.generation_id != b.generation_id
        assert [g.generation_id for g in mgr.generations()] == [b.generation_id, a.generation_id]
        for file in Path(a.path).iterdir():
            assert file.stat().st_mode & 0o222 == 0
        # Among generations of one step the newest valid one is taken.
        restored = {"x": torch.zeros(2)}
        assert mgr.restore(restored, step=5).generation_id == b.generation_id
        assert torch.equal(restored["x"], torch.full((2,), 2.0))


_HOLDER = textwrap.dedent(
    """
    import sys, time, torch, ckptvault as cv
    mgr = cv.CheckpointManager(sys.argv[1], run_id="r")
    mgr.save(1, {"x": torch.ones(2)})
    print("saved", flush=True)
    time.sleep(600)
    """
)


def test_second_writer_is_refused_and_a_killed_writer_leaves_no_stale_lock(store: Path):
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(store)], stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert holder.stdout.readline().strip() == "saved"
        with cv.CheckpointManager(store, run_id="r") as mgr:
            with pytest.raises(StoreLockedError, match=rf"pid {holder.pid}"):
                mgr.save(2, {"x": torch.ones(2)})
            # Readers are never blocked by the writer lock.
            assert mgr.restore({"x": torch.zeros(2)}).step == 1
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(2, {"x": torch.ones(2)})
        assert [g.step for g in mgr.generations()] == [2, 1]


def test_two_managers_in_one_process_do_not_interleave(store: Path):
    with cv.CheckpointManager(store, run_id="r") as first:
        first.save(1, {"x": torch.ones(1)})
        second = cv.CheckpointManager(store, run_id="r")
        with pytest.raises(StoreLockedError):
            second.save(2, {"x": torch.ones(1)})
        second.close()
    with cv.CheckpointManager(store, run_id="r") as third:
        third.save(3, {"x": torch.ones(1)})


@pytest.fixture
def tiny_filesystem(tmp_path: Path):
    with mounted_tmpfs(tmp_path / "tiny", "size=2m") as mount_point:
        yield mount_point


def test_full_disk_is_a_typed_error_and_loses_nothing(tiny_filesystem: Path):
    store = tiny_filesystem / "store"
    small = {"model": torch.nn.Linear(10, 10)}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, small)
        with pytest.raises(StorageFullError, match="full"):
            mgr.save(2, {"big": torch.zeros(1024, 1024)})  # 4 MiB on a 2 MiB filesystem
        assert [g.step for g in mgr.generations()] == [1]
        assert os.listdir(store / ".staging") == []
        fresh = {"model": torch.nn.Linear(10, 10)}
        assert mgr.restore(fresh).step == 1
        assert torch.equal(fresh["model"].weight, small["model"].weight)
        mgr.save(3, small)  # space was reclaimed
