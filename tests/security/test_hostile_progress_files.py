"""A progress file is written by the job and read by the supervisor's hang watchdog:
whatever a process of the job writes there must not take the supervisor down."""

from __future__ import annotations

import json
from pathlib import Path


def test_a_progress_record_with_a_number_no_float_holds_is_refused_not_raised(tmp_path: Path):
    """A process of the job writes ``"at": 10**400`` into its progress file: JSON
    allows it, and ``math.isfinite`` then raised OverflowError out of the watchdog's
    scan, which took the supervisor down and left the job unwatched. It is a record
    that cannot be read: reported, and the watch goes on."""
    from ckptvault.observe.heartbeat import RECORD_KIND, RECORD_VERSION, scan_progress
    from ckptvault.ops.hang import HangPolicy, HangWatch, IntervalHistory

    fields = {"run_id": "r", "world_size": 1, "pid": 1, "step": 1, "beats": 1, "at": 1.0}
    good = {"kind": RECORD_KIND, "version": RECORD_VERSION, "rank": 0, **fields}
    (tmp_path / "rank0.json").write_text(json.dumps(good))
    for rank, field in ((1, "at"), (2, "step_seconds")):
        text = json.dumps({**good, "rank": rank, field: 0}).replace(
            f'"{field}": 0', f'"{field}": 1{"0" * 400}'
        )
        (tmp_path / f"rank{rank}.json").write_text(text)
    records, problems = scan_progress(tmp_path)
    assert [r.rank for r in records] == [0]
    assert len(problems) == 2 and all("must be" in p for p in problems)
    warned: list[str] = []
    watch = HangWatch(tmp_path, HangPolicy(timeout_s=60), IntervalHistory(), warned.append)
    assert watch.check() is None and len(warned) == 2


def test_a_directory_for_a_rank_file_leaks_no_descriptor(tmp_path: Path):
    """A process of the job makes ``rank0.json`` a directory. Opening it succeeded,
    ``os.fdopen`` then raised IsADirectoryError and the descriptor was never closed:
    one leaked per read, four reads a second, until the supervisor could open nothing
    (EMFILE: no listing, no restart). It is refused as not a plain file, and closed."""
    import os

    import pytest

    from ckptvault.errors import UnsafeEntryError
    from ckptvault.observe.heartbeat import read_progress

    (tmp_path / "rank0.json").mkdir()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        with pytest.raises(UnsafeEntryError, match="not a plain file"):
            read_progress(tmp_path / "rank0.json")
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_done_record_that_is_a_directory_is_refused_by_name_and_closed(tmp_path: Path):
    """The supervisor and ``status --done-file`` read the DONE record the job writes.
    A directory there raised IsADirectoryError ('Is a directory: 3', the descriptor's
    number, not the path) and leaked the descriptor, as progress files did."""
    import os

    import pytest

    from ckptvault.errors import UnsafeEntryError
    from ckptvault.ops.done import read_done_record

    (tmp_path / "DONE").mkdir()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(UnsafeEntryError, match="not a plain file"):
            read_done_record(tmp_path / "DONE")
    assert len(os.listdir("/proc/self/fd")) == before
