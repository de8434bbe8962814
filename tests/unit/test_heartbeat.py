"""``mgr.heartbeat(step)``: where a manager records progress, what it writes, and what
it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.observe.heartbeat import (
    PROGRESS_DIR_ENV,
    default_progress_directory,
    read_progress,
    scan_progress,
)


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
