"""``mgr.heartbeat(step)``: where a manager records progress, what it writes, and what
it refuses; a save records its bytes as it writes them."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.observe.heartbeat import (
    PROGRESS_DIR_ENV,
    ProgressRecord,
    default_progress_directory,
    read_progress,
    scan_progress,
)
from ckptvault.ops.drills.storage import ThrottledStore
from ckptvault.storage import open_store

MIB = 2**20


def test_under_supervise_progress_goes_where_the_supervisor_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PROGRESS_DIR_ENV, str(tmp_path / "attempt-1"))
    with cv.CheckpointManager(tmp_path / "store", run_id="r", catalog=False) as mgr:
        mgr.heartbeat(3)
        (record,), problems = scan_progress(tmp_path / "attempt-1")
    assert problems == []
    assert (record.run_id, record.rank, record.world_size, record.step) == ("r", 0, 1, 3)
    assert record.beats == 1 and record.step_seconds is None


def test_otherwise_beside_the_ledger(tmp_path: Path, isolated_state_dir: Path) -> None:
    with cv.CheckpointManager(tmp_path / "a", run_id="run/one", catalog=False) as mgr:
        mgr.save(1, {"w": torch.ones(2)})  # a save reports progress too
        written = mgr._progress.writer.path
    assert written.parent == default_progress_directory("run/one", None)
    assert written.parent.parent == isolated_state_dir / "progress"
    assert read_progress(written).step == 1
    ledger = tmp_path / "keys" / "ledger.sqlite3"
    with cv.CheckpointManager(tmp_path / "b", run_id="r", ledger=ledger, catalog=False) as mgr:
        mgr.heartbeat(1)
    assert (scan_progress(default_progress_directory("r", ledger))[0][0]).step == 1
    assert default_progress_directory("r", ledger).parent == tmp_path / "keys" / "progress"


def test_one_process_shows_its_step_time_in_the_metrics(tmp_path: Path) -> None:
    pytest.importorskip("prometheus_client")
    with cv.CheckpointManager(tmp_path / "store", run_id="r", catalog=False) as mgr:
        for step in range(3):
            mgr.heartbeat(step, step_seconds=0.25)
        times, stragglers = mgr._progress.rank_times.snapshot()
    assert times == {0: 0.25} and stragglers == set()


@pytest.mark.parametrize("bad", [-1.0, float("nan"), "fast", True])
def test_a_step_time_that_is_not_seconds_is_refused(tmp_path: Path, bad: object) -> None:
    refused = pytest.raises(cv.errors.UsageError, match="step_seconds")
    with cv.CheckpointManager(tmp_path / "store", run_id="r", catalog=False) as mgr, refused:
        mgr.heartbeat(1, step_seconds=bad)  # type: ignore[arg-type]


def test_a_closed_manager_refuses_heartbeats(tmp_path: Path) -> None:
    mgr = cv.CheckpointManager(tmp_path / "store", run_id="r", catalog=False)
    mgr.close()
    with pytest.raises(cv.errors.UsageError, match="closed"):
        mgr.heartbeat(1)


def watched_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fail_at: int | None = None
) -> tuple[list[ProgressRecord], ProgressRecord]:
    """Save 4 MiB (1 MiB tensors: a write each) into a store that reads the rank's
    progress file before each write, and raises at the ``fail_at``-th write; the
    records read, and the one left after the save."""
    monkeypatch.setenv(PROGRESS_DIR_ENV, str(tmp_path / "progress"))
    store = ThrottledStore(open_store(tmp_path / "store"))
    seen: list[ProgressRecord] = []
    with cv.CheckpointManager(store, run_id="r", catalog=False, threads=1) as mgr:
        writer = mgr._progress.writer
        writer.interval_s = 0  # a record at every write, until the third

        def before_write(nbytes: int) -> None:
            seen.append(read_progress(writer.path))
            if len(seen) == 3:
                writer.interval_s = 3600  # from here, only the save's end may write
            if len(seen) == fail_at:
                raise OSError(5, "Input/output error")

        store.throttle.consume = before_write  # type: ignore[method-assign]
        state = {f"layer{i}": torch.ones(MIB // 4) for i in range(4)}
        try:
            mgr.save(7, state)
        finally:
            store.throttle.consume = lambda nbytes: None  # type: ignore[method-assign]
            after = read_progress(writer.path)
    return seen, after


def test_a_save_records_its_bytes_as_it_writes_and_training_once_done(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen, after = watched_save(tmp_path, monkeypatch)
    started, header, first = seen[:3]
    # Said as the save starts, before its first byte: a dead store hangs it right there.
    assert (started.phase, started.step, started.saved_bytes) == ("saving", 7, 0)
    assert header.phase == first.phase == "saving"
    assert first.saved_bytes - header.saved_bytes == MIB  # the first tensor's write
    assert all(r.beats == started.beats for r in seen)  # bytes, not heartbeats
    # The save's end replaced the last "saving" record, however recent it was.
    assert after.phase == "training" and after.beats == started.beats
    assert after.saved_bytes > 4 * MIB


def test_a_save_that_fails_leaves_the_training_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises((OSError, cv.errors.CheckpointError)):
        watched_save(tmp_path, monkeypatch, fail_at=4)
    (after,), _ = scan_progress(tmp_path / "progress")
    assert after.phase == "training" and after.saved_bytes > 2 * MIB


def test_a_preemptions_final_save_reports_as_it_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PROGRESS_DIR_ENV, str(tmp_path / "progress"))
    preemptible = cv.CheckpointManager(
        tmp_path / "store", run_id="r", catalog=False, save_on_signal=(signal.SIGUSR1,)
    )
    with preemptible as mgr:
        writer = mgr._progress.writer
        written: list[tuple[str, int]] = []
        replace = writer._replace

        def spy(data: bytes) -> None:
            record = json.loads(data)
            written.append((record["phase"], record["saved_bytes"]))
            replace(data)

        monkeypatch.setattr(writer, "_replace", spy)
        mgr.heartbeat(1)
        signal.raise_signal(signal.SIGUSR1)  # the scheduler's notice
        with pytest.raises(cv.Preempted):
            mgr.save(2, {"w": torch.ones(MIB // 4)})
    # Said as the final save began and once it ended, whatever the throttle.
    assert ("saving", 0) in written
    assert written[-1][0] == "training" and written[-1][1] > MIB


def test_a_memory_tiers_durable_copy_reports_its_bytes_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PROGRESS_DIR_ENV, str(tmp_path / "progress"))
    tier = cv.MemoryTier(path=tmp_path / "memory", keep=1, durable_every=1)
    with cv.CheckpointManager(
        tmp_path / "store", run_id="r", catalog=False, memory_tier=tier
    ) as mgr:
        mgr.save(1, {"w": torch.ones(MIB // 4)})
        saved = mgr._progress.saved_bytes
    assert saved > 2 * MIB  # written into memory, then copied into the store


def test_a_background_save_reports_its_bytes_and_ends_in_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(PROGRESS_DIR_ENV, str(tmp_path / "progress"))
    with cv.CheckpointManager(tmp_path / "store", run_id="r", catalog=False) as mgr:
        mgr.save(1, {"w": torch.ones(MIB // 4)}, blocking=False)
        mgr.wait()
        after = read_progress(mgr._progress.writer.path)
    assert after.phase == "training" and after.saved_bytes > MIB
