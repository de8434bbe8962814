"""``ckptvault supervise --hang-timeout/--hang-factor``: a job whose progress stops is
killed, recorded as a ``hang`` attempt and restarted; the progress files it reads are
untrusted input."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from ckptvault.errors import CheckpointError, FormatError, UnsafeEntryError, UsageError
from ckptvault.observe.catalog import Catalog
from ckptvault.observe.catalog_attempts import recent_attempts
from ckptvault.observe.heartbeat import (
    MAX_RECORD_BYTES,
    ProgressRecord,
    ProgressWriter,
    read_progress,
    scan_progress,
)
from ckptvault.ops.hang import DEFAULT_FLOOR_S, HangPolicy, HangWatch, IntervalHistory
from ckptvault.ops.supervise import Action, Outcome, Policy, decide
from support.common import run_cli


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def record(
    rank: int = 0,
    beats: int = 1,
    step: int = 1,
    pid: int = 42,
    phase: str = "training",
    saved_bytes: int = 0,
) -> ProgressRecord:
    return ProgressRecord("r", rank, 2, pid, step, beats, 1.0, None, phase, saved_bytes)


def beat(directory: Path, clock: Clock, **fields: int | str) -> None:
    writer = ProgressWriter(directory, int(fields.get("rank", 0)), interval_s=0, clock=clock)
    writer.offer(lambda: record(**fields))  # type: ignore[arg-type]


# -- writing: cheap and bounded -------------------------------------------------------


def test_the_writer_writes_at_most_once_per_interval(tmp_path: Path) -> None:
    clock = Clock()
    writer = ProgressWriter(tmp_path / "p", 0, interval_s=0.5, clock=clock)
    for beats in range(1, 1001):  # a thousand heartbeats within a second
        writer.offer(lambda beats=beats: record(beats=beats))  # type: ignore[misc]
        clock.now += 1 / 1024
    assert writer.writes == 2  # at 0 s and at 0.5 s
    assert read_progress(writer.path).beats == 513
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["rank0.json"]


def test_threads_writing_at_once_never_leave_half_a_record(tmp_path: Path) -> None:
    # A save's writer threads report its bytes while the training thread beats.
    writer = ProgressWriter(tmp_path, 0, interval_s=0)
    stop, unreadable = threading.Event(), []

    def read() -> None:
        while not stop.is_set():
            try:
                read_progress(writer.path)
            except FileNotFoundError:
                pass
            except (OSError, CheckpointError) as exc:
                unreadable.append(exc)

    def offer(rank_of_thread: int) -> None:
        for beats in range(1, 151):
            force = beats % 50 == 0
            writer.offer(lambda beats=beats: record(beats=beats, step=rank_of_thread), force=force)

    threads = [threading.Thread(target=offer, args=(n,)) for n in range(4)]
    reader = threading.Thread(target=read)
    reader.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop.set()
    reader.join()
    assert unreadable == [] and writer.writes >= 12  # every forced write at least
    assert read_progress(writer.path) == writer.last
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.json"]


def test_a_write_that_fails_never_fails_the_step(tmp_path: Path, caplog) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")
    writer = ProgressWriter(blocked / "p", 0, interval_s=0)
    assert writer.offer(record) is False and writer.offer(record) is False
    assert caplog.text.count("cannot record progress") == 1


# -- reading: untrusted ---------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        b"[" * 100 + b"]" * 100,
        b'{"kind": "something else"}',
        json.dumps({**record().to_json(), "step": -1}).encode(),
        json.dumps({**record().to_json(), "at": "soon"}).encode(),
        json.dumps({**record().to_json(), "extra": 1}).encode(),
        json.dumps({**record().to_json(), "version": 99}).encode(),
        json.dumps({**record().to_json(), "version": 1}).encode(),  # before phase
        json.dumps({**record().to_json(), "phase": "eating"}).encode(),
        json.dumps({**record().to_json(), "phase": ["saving"]}).encode(),
        json.dumps({**record().to_json(), "saved_bytes": -1}).encode(),
        json.dumps({**record().to_json(), "saved_bytes": 1.5}).encode(),
        json.dumps({**record().to_json(), "saved_bytes": 2**63}).encode(),
        b" " * (MAX_RECORD_BYTES + 1),
    ],
)
def test_a_bad_record_is_a_format_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "rank0.json"
    path.write_bytes(content)
    with pytest.raises(FormatError):
        read_progress(path)


def test_links_fifos_and_foreign_ranks_are_refused_and_reported(tmp_path: Path) -> None:
    clock = Clock()
    beat(tmp_path, clock, rank=0)
    os.symlink(tmp_path / "rank0.json", tmp_path / "rank1.json")
    os.mkfifo(tmp_path / "rank2.json")  # would block an open without O_NONBLOCK
    (tmp_path / "rank3.json").write_text(json.dumps(record(rank=0).to_json()))
    with pytest.raises(UnsafeEntryError):
        read_progress(tmp_path / "rank1.json")
    records, problems = scan_progress(tmp_path)
    assert [r.rank for r in records] == [0]
    assert len(problems) == 3, problems
    assert any("names rank 0" in p for p in problems)


# -- the watch and the policy -----------------------------------------------------------


def test_no_report_yet_is_never_a_hang(tmp_path: Path) -> None:
    clock = Clock()
    watch = HangWatch(tmp_path, HangPolicy(timeout_s=2), IntervalHistory(), print, clock)
    clock.now += 10 * DEFAULT_FLOOR_S
    assert watch.check() is None


def test_the_stalest_rank_decides(tmp_path: Path) -> None:
    clock, warnings = Clock(), []
    watch = HangWatch(tmp_path, HangPolicy(timeout_s=2), IntervalHistory(), warnings.append, clock)
    beat(tmp_path, clock, rank=0, beats=1)
    beat(tmp_path, clock, rank=1, beats=1, step=7)
    assert watch.check() is None
    for n in range(2, 10):  # rank 0 goes on, rank 1 stops
        clock.now += 0.5
        beat(tmp_path, clock, rank=0, beats=n)
        verdict = watch.check()
    assert verdict is not None and "rank 1 last reported step 7" in verdict
    assert not warnings


def test_the_factor_scales_with_the_reporting_interval_above_its_floor() -> None:
    policy = HangPolicy(timeout_s=2, factor=10)
    assert policy.limit(None) == 2 and policy.limit(0.1) == 2 and policy.limit(1.0) == 10
    assert HangPolicy(factor=3).limit(1.0) == DEFAULT_FLOOR_S


def test_with_a_factor_the_limit_follows_the_reporting_interval(tmp_path: Path) -> None:
    clock = Clock()
    policy = HangPolicy(timeout_s=1, factor=4)
    watch = HangWatch(tmp_path, policy, IntervalHistory(), print, clock)
    for n in range(1, 6):  # a report every 2 s: the limit becomes 4 x 2 s
        beat(tmp_path, clock, beats=n)
        assert watch.check() is None
        clock.now += 2
    clock.now += 5.5  # 7.5 s since the last report: under 8 s
    assert watch.check() is None
    clock.now += 1
    verdict = watch.check()
    assert verdict is not None and "limit 8 s" in verdict


def test_a_save_that_writes_is_progress_and_one_that_stops_hangs_during_it(
    tmp_path: Path,
) -> None:
    clock, history = Clock(), IntervalHistory()
    watch = HangWatch(tmp_path, HangPolicy(timeout_s=2, factor=3), history, print, clock)
    beat(tmp_path, clock, beats=1, step=7)  # save(7) reports when it starts
    assert watch.check() is None
    for n in range(1, 21):  # 10 s of writing, far past the limit, without a heartbeat
        clock.now += 0.5
        beat(tmp_path, clock, beats=1, step=7, phase="saving", saved_bytes=n * 1_000_000)
        assert watch.check() is None
    assert list(history.intervals) == []  # a save's bytes are not the job's cadence
    clock.now += 2.5  # then the storage stops answering
    verdict = watch.check()
    assert verdict is not None
    assert "rank 0 last reported step 7, during a save that stopped writing" in verdict


def test_a_hang_after_a_save_is_not_blamed_on_it(tmp_path: Path) -> None:
    clock = Clock()
    watch = HangWatch(tmp_path, HangPolicy(timeout_s=2), IntervalHistory(), print, clock)
    beat(tmp_path, clock, beats=1, phase="saving", saved_bytes=10)
    assert watch.check() is None
    clock.now += 0.5
    beat(tmp_path, clock, beats=1, phase="training", saved_bytes=10)  # the save ended
    assert watch.check() is None
    clock.now += 2.5
    verdict = watch.check()
    assert verdict is not None and verdict.endswith("rank 0 last reported step 1")


@pytest.mark.parametrize(
    "options", [{}, {"timeout_s": 0.1}, {"timeout_s": float("inf")}, {"factor": 0.5}]
)
def test_policy_refuses_nonsense(options: dict) -> None:
    with pytest.raises(UsageError):
        HangPolicy(**options)


@pytest.mark.parametrize("option", [["--hang-timeout", "0.1"], ["--hang-factor", "0.5"]])
def test_a_bad_hang_option_is_one_line_and_exit_2(option: list[str]) -> None:
    result = run_cli("supervise", *option, "--no-catalog", "--", sys.executable, "-c", "")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("ckptvault: error: " + option[0]), result.stderr
    assert len(result.stderr.splitlines()) == 1 and "attempt 1" not in result.stderr


def test_a_hang_is_a_failure_within_the_budget() -> None:
    hung = Outcome(returncode=-9, hung="no progress for 3 s")
    again = decide(hung, failures=0, preemptions=0, policy=Policy(backoff_s=(0,)))
    assert (again.action, again.kind) == (Action.RESTART, "hang")
    last = decide(hung, failures=2, preemptions=0, policy=Policy())
    assert (last.action, last.kind, last.exit_code) == (Action.STOP, "hang", 137)
    assert "no progress for 3 s" in last.reason
    # The job finished as the watchdog stopped it: success wins.
    done = decide(Outcome(returncode=0, hung="x"), failures=0, preemptions=0, policy=Policy())
    assert done.action is Action.FINISH


# -- a real job that deadlocks ----------------------------------------------------------


DEADLOCKING_JOB = """
    import os, signal, sys, threading, time
    import ckptvault as cv

    attempt = int(os.environ["CKPTVAULT_ATTEMPT"])
    with cv.CheckpointManager(sys.argv[1], run_id="hang", catalog=False) as mgr:
        for step in range(4):
            mgr.heartbeat(step)
            time.sleep(0.05)
        if attempt == 1:
            # Stuck as a rank in a collective is: deaf to SIGTERM, and forever.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            a, b = threading.Lock(), threading.Lock()

            def take(first, second):
                with first:
                    time.sleep(0.2)
                    with second:
                        pass

            threads = [threading.Thread(target=take, args=pair) for pair in ((a, b), (b, a))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
    print(f"attempt {attempt} finished")
"""


def test_a_deadlocked_job_is_killed_recorded_as_a_hang_and_restarted(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(DEADLOCKING_JOB))
    catalog, log = tmp_path / "catalog.sqlite3", tmp_path / "attempts.jsonl"
    result = run_cli(
        "supervise",
        "--hang-timeout", "1.5",
        "--grace-seconds", "0.5",
        "--backoff", "0",
        "--catalog", str(catalog),
        "--log", str(log),
        "--",
        sys.executable, str(script), str(tmp_path / "store"),
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "attempt 2 finished" in result.stdout and "attempt 1 finished" not in result.stdout
    assert "hang: no progress for" in result.stderr
    assert "did not exit within 0.5 s: SIGKILL" in result.stderr
    with Catalog(catalog) as book:
        attempts = recent_attempts(book)
    assert [(a.attempt, a.kind, a.decision, a.signal) for a in attempts] == [
        (1, "hang", "restart", "SIGKILL"),
        (2, "success", "finish", None),
    ]
    assert "rank 0 last reported step" in attempts[0].reason
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert logged[0]["hung"].startswith("no progress for")


# -- a real job whose save outlasts the limit -------------------------------------------


SAVING_JOB = """
    import sys, time
    import torch
    import ckptvault as cv
    from ckptvault.ops.drills.storage import ThrottledStore
    from ckptvault.storage import open_store

    MIB = 2**20
    # 24 writes of 1 MiB at 8 MiB/s: a synchronous save of about 3 s, writing all along.
    store = ThrottledStore(open_store(sys.argv[1]), bytes_per_s=8 * MIB)
    if sys.argv[2] == "stall":
        throttle, writes = store.throttle.consume, []

        def consume(nbytes):
            writes.append(nbytes)
            if len(writes) == 12:
                time.sleep(60)  # the storage stops answering in the middle of the save
            throttle(nbytes)

        store.throttle.consume = consume
    state = {f"layer{i}": torch.ones(MIB // 4) for i in range(24)}
    with cv.CheckpointManager(store, run_id="slow-save", catalog=False, threads=1) as mgr:
        for step in range(3):
            mgr.heartbeat(step)
            time.sleep(0.05)
        started = time.monotonic()
        mgr.save(3, state)
        print(f"saved in {time.monotonic() - started:.1f} s", flush=True)
        mgr.heartbeat(4)
"""


def supervise_saving_job(tmp_path: Path, mode: str) -> tuple[Any, list[dict[str, Any]]]:
    """``supervise --hang-timeout 1.5`` of :data:`SAVING_JOB` (no restart); what it
    returned and its attempt log. (1 s, the least allowed, would hold too: a record
    changes at least every 0.5 s while bytes flow and is read every 0.25 s; the
    margin is for a machine loaded by parallel tests.)"""
    script, log = tmp_path / "job.py", tmp_path / "attempts.jsonl"
    script.write_text(textwrap.dedent(SAVING_JOB))
    result = run_cli(
        "supervise",
        "--hang-timeout", "1.5",
        "--grace-seconds", "0.5",
        "--max-restarts", "0",
        "--no-catalog",
        "--log", str(log),
        "--",
        sys.executable, str(script), str(tmp_path / "store"), mode,
        timeout=120,
    )  # fmt: skip
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    return result, [entry for entry in logged if entry.get("event") == "attempt"]


def test_a_save_writing_longer_than_the_limit_is_not_a_hang(tmp_path: Path) -> None:
    result, attempts = supervise_saving_job(tmp_path, "steady")
    assert result.returncode == 0, result.stderr
    assert "hang:" not in result.stderr
    assert [(a["attempt"], a["kind"]) for a in attempts] == [(1, "success")]
    seconds = float(result.stdout.split("saved in ")[1].split(" s")[0])
    assert seconds > 2.5, result.stdout  # the save did outlast the limit: what is tested


def test_a_save_whose_writes_stop_is_a_hang_during_the_save(tmp_path: Path) -> None:
    result, attempts = supervise_saving_job(tmp_path, "stall")
    assert result.returncode != 0 and "saved in" not in result.stdout
    assert [(a["attempt"], a["kind"]) for a in attempts] == [(1, "hang")]
    assert attempts[0]["hung"].startswith("no progress for")
    assert "rank 0 last reported step 3, during a save that stopped writing" in attempts[0]["hung"]
    assert "during a save" in result.stderr
