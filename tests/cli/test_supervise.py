"""``ckptvault supervise``: bounded restarts, cancellation, stop file, preflight and the
DONE record, with real child processes (tiny backoffs keep each test to seconds)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from blake3 import blake3

from ckptvault.errors import FormatError, UsageError
from ckptvault.exit_codes import PERMANENT_FAILURE, PREEMPTED
from ckptvault.ops.done import (
    DONE_FILE_ENV,
    check_done_record,
    read_done_record,
    write_done_record,
)
from ckptvault.ops.supervise import (
    DONE_MISMATCH,
    NO_SPACE,
    NOT_FOUND,
    Action,
    Outcome,
    Policy,
    decide,
)
from support.common import run_cli

FAST = ["--backoff", "0,0.05"]


def child_script(tmp_path: Path, body: str) -> list[str]:
    """A job that counts its starts in ``starts`` and then runs ``body`` (with ``n``
    bound to this start's number, 1-based)."""
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import os, signal, sys, time
            from pathlib import Path
            counter = Path({str(tmp_path / "starts")!r})
            n = int(counter.read_text()) + 1 if counter.exists() else 1
            counter.write_text(str(n))
            """
        )
        + textwrap.dedent(body)
    )
    return [sys.executable, str(script)]


def starts(tmp_path: Path) -> int:
    counter = tmp_path / "starts"
    return int(counter.read_text()) if counter.exists() else 0


def supervise(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return run_cli("supervise", *args, timeout=timeout)


def log_records(path: Path, event: str = "attempt") -> list[dict]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if r["event"] == event]


# -- the policy ---------------------------------------------------------------------


def test_decide_success_permanent_and_preempted() -> None:
    policy = Policy()
    assert decide(Outcome(0), failures=2, preemptions=0, policy=policy).action is Action.FINISH
    permanent = decide(Outcome(PERMANENT_FAILURE), failures=0, preemptions=0, policy=policy)
    assert (permanent.action, permanent.exit_code) == (Action.STOP, PERMANENT_FAILURE)
    preempted = decide(Outcome(PREEMPTED), failures=2, preemptions=5, policy=policy)
    assert (preempted.action, preempted.delay_s) == (Action.RESTART, 0.0)
    over = decide(Outcome(PREEMPTED), failures=0, preemptions=100, policy=policy)
    assert (over.action, over.exit_code) == (Action.STOP, PREEMPTED)


def test_decide_failures_back_off_then_give_up_with_the_childs_code() -> None:
    policy = Policy(max_restarts=3, backoff_s=(10, 20))
    delays = [
        decide(Outcome(1), failures=f, preemptions=0, policy=policy).delay_s for f in range(3)
    ]
    assert delays == [10, 20, 20]  # the last value repeats
    final = decide(Outcome(7), failures=3, preemptions=0, policy=policy)
    assert (final.action, final.exit_code) == (Action.STOP, 7)
    killed = decide(Outcome(-signal.SIGKILL), failures=3, preemptions=0, policy=policy)
    assert killed.exit_code == 128 + signal.SIGKILL
    refused = decide(Outcome(refused="disk"), failures=3, preemptions=0, policy=policy)
    assert (refused.kind, refused.exit_code) == ("refused", NO_SPACE)


def test_decide_cancellation_and_stop_file_never_restart() -> None:
    policy = Policy()
    for outcome in (Outcome(1), Outcome(PREEMPTED), Outcome(-signal.SIGTERM), Outcome(0)):
        cancelled = decide(
            outcome, failures=0, preemptions=0, policy=policy, cancelled_by=signal.SIGTERM
        )
        assert (cancelled.action, cancelled.exit_code) == (Action.STOP, 143)
    stopped = decide(Outcome(3), failures=0, preemptions=0, policy=policy, stop_file=True)
    assert (stopped.action, stopped.exit_code, stopped.kind) == (Action.STOP, 3, "stopped")
    finished = decide(Outcome(0), failures=0, preemptions=0, policy=policy, stop_file=True)
    assert finished.action is Action.FINISH
    spawn = decide(Outcome(spawn_error=NOT_FOUND), failures=0, preemptions=0, policy=policy)
    assert (spawn.action, spawn.exit_code) == (Action.STOP, NOT_FOUND)


@pytest.mark.parametrize("bad", [{"max_restarts": -1}, {"backoff_s": ()}, {"backoff_s": (1, -2)}])
def test_policy_rejects_nonsense(bad: dict) -> None:
    with pytest.raises(UsageError):
        Policy(**bad)


# -- restarts -----------------------------------------------------------------------


def test_fails_twice_then_succeeds_after_three_starts(tmp_path: Path) -> None:
    cmd = child_script(tmp_path, "sys.exit(0 if n == 3 else 1)")
    log = tmp_path / "log.jsonl"
    result = supervise(*FAST, "--log", str(log), "--", *cmd)
    assert result.returncode == 0, result.stderr
    assert starts(tmp_path) == 3
    attempts = log_records(log)
    assert [a["attempt"] for a in attempts] == [1, 2, 3]
    assert [a["exit_code"] for a in attempts] == [1, 1, 0]
    assert [a["decision"] for a in attempts] == ["restart", "restart", "finish"]
    assert all(a["ended_at"] >= a["started_at"] > 0 for a in attempts)
    assert log_records(log, "exit")[0]["exit_code"] == 0
    assert "attempt 2: start" in result.stderr and "backoff: waiting 0.05 s" in result.stderr


def test_budget_exhausted_gives_up_with_the_childs_code(tmp_path: Path) -> None:
    cmd = child_script(tmp_path, "sys.exit(9)")
    result = supervise(*FAST, "--", *cmd)
    assert result.returncode == 9
    assert starts(tmp_path) == 3  # default: 1 start + 2 restarts
    assert "giving up after 3 failed attempts" in result.stderr

    (tmp_path / "starts").unlink()
    result = supervise("--max-restarts", "4", "--backoff", "0", "--", *cmd)
    assert (result.returncode, starts(tmp_path)) == (9, 5)


def test_permanent_code_stops_after_one_start(tmp_path: Path) -> None:
    cmd = child_script(tmp_path, f"sys.exit({PERMANENT_FAILURE})")
    result = supervise(*FAST, "--", *cmd)
    assert (result.returncode, starts(tmp_path)) == (PERMANENT_FAILURE, 1)
    assert "permanent" in result.stderr


def test_preempted_restarts_without_using_the_budget(tmp_path: Path) -> None:
    # Preempted 3 times, then fails once, then succeeds: 5 starts with --max-restarts 1.
    cmd = child_script(tmp_path, f"sys.exit({PREEMPTED} if n <= 3 else (1 if n == 4 else 0))")
    log = tmp_path / "log.jsonl"
    result = supervise("--max-restarts", "1", "--backoff", "0", "--log", str(log), "--", *cmd)
    assert result.returncode == 0, result.stderr
    assert starts(tmp_path) == 5
    assert [a["kind"] for a in log_records(log)] == ["preempted"] * 3 + ["failure", "success"]


def test_preemptions_are_bounded_too(tmp_path: Path) -> None:
    cmd = child_script(tmp_path, f"sys.exit({PREEMPTED})")
    result = supervise("--max-preemptions", "2", "--", *cmd)
    assert (result.returncode, starts(tmp_path)) == (PREEMPTED, 3)
    assert "--max-preemptions 2" in result.stderr


def test_death_by_sigkill_is_a_failure(tmp_path: Path) -> None:
    cmd = child_script(tmp_path, "os.kill(os.getpid(), signal.SIGKILL) if n == 1 else None")
    log = tmp_path / "log.jsonl"
    result = supervise(*FAST, "--log", str(log), "--", *cmd)
    assert (result.returncode, starts(tmp_path)) == (0, 2)
    first = log_records(log)[0]
    assert (first["signal"], first["exit_code"], first["kind"]) == ("SIGKILL", None, "failure")
    assert "killed by SIGKILL" in result.stderr


def test_a_command_that_does_not_exist_is_not_retried(tmp_path: Path) -> None:
    result = supervise(*FAST, "--", str(tmp_path / "no-such-program"))
    assert (result.returncode, result.stderr.count("start:")) == (NOT_FOUND, 1)


# -- cancellation and stop file -----------------------------------------------------


def started_supervisor(tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    """The supervisor in the background, once its job has written ``ready``."""
    command = [sys.executable, "-m", "ckptvault", "supervise", *args]
    proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "ready").exists():
        assert time.monotonic() < deadline and proc.poll() is None, "the job never started"
        time.sleep(0.05)
    return proc


def test_sigterm_is_forwarded_and_never_restarts(tmp_path: Path) -> None:
    got = tmp_path / "got-sigterm"
    cmd = child_script(
        tmp_path,
        f"""
        def on_term(signum, frame):
            Path({str(got)!r}).write_text("yes")
            sys.exit(1)  # a failure code: still must not restart
        signal.signal(signal.SIGTERM, on_term)
        Path({str(tmp_path / "ready")!r}).write_text("ready")
        time.sleep(60)
        """,
    )
    log = tmp_path / "log.jsonl"
    proc = started_supervisor(tmp_path, *FAST, "--log", str(log), "--", *cmd)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143, stderr
    assert got.read_text() == "yes"
    assert starts(tmp_path) == 1
    assert "cancelled by SIGTERM" in stderr
    assert [a["kind"] for a in log_records(log)] == ["cancelled"]


def test_a_job_that_ignores_the_signal_is_killed_after_the_grace_period(tmp_path: Path) -> None:
    cmd = child_script(
        tmp_path,
        f"""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        Path({str(tmp_path / "ready")!r}).write_text("ready")
        time.sleep(60)
        """,
    )
    proc = started_supervisor(tmp_path, "--grace-seconds", "0.5", "--", *cmd)
    began = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 130, stderr
    assert time.monotonic() - began < 20
    assert "SIGKILL" in stderr and starts(tmp_path) == 1


def test_stop_file_prevents_a_restart(tmp_path: Path) -> None:
    stop = tmp_path / "STOP"
    cmd = child_script(tmp_path, f"Path({str(stop)!r}).touch(); sys.exit(4)")
    result = supervise(*FAST, "--stop-file", str(stop), "--", *cmd)
    assert (result.returncode, starts(tmp_path)) == (4, 1)
    assert "stopped by stop file" in result.stderr


def test_stop_file_present_before_the_first_start(tmp_path: Path) -> None:
    stop = tmp_path / "STOP"
    stop.touch()
    cmd = child_script(tmp_path, "sys.exit(0)")
    result = supervise("--stop-file", str(stop), "--", *cmd)
    assert (result.returncode, starts(tmp_path)) == (0, 0)
    assert "stopped by stop file" in result.stderr


# -- preflight ----------------------------------------------------------------------


def test_preflight_with_too_little_space_never_starts_the_job(tmp_path: Path) -> None:
    cmd = child_script(tmp_path, "sys.exit(0)")
    log = tmp_path / "log.jsonl"
    store = tmp_path / "store"  # not created yet: its nearest parent is checked
    result = supervise(
        *FAST, "--store", str(store), "--min-free-bytes", "1000000T", "--log", str(log), "--", *cmd
    )
    assert (result.returncode, starts(tmp_path)) == (NO_SPACE, 0)
    assert "--min-free-bytes asks for" in result.stderr
    assert "giving up after 3 failed attempts" in result.stderr
    assert [a["kind"] for a in log_records(log)] == ["refused"] * 3


def test_preflight_passes_with_enough_space(tmp_path: Path) -> None:
    cmd = child_script(tmp_path, "sys.exit(0)")
    result = supervise("--store", f"file://{tmp_path}", "--min-free-bytes", "1K", "--", *cmd)
    assert (result.returncode, starts(tmp_path)) == (0, 1), result.stderr


def test_min_free_bytes_needs_a_store_and_a_valid_size(tmp_path: Path) -> None:
    assert supervise("--min-free-bytes", "1G", "--", "true").returncode == 2
    bad = supervise("--store", str(tmp_path), "--min-free-bytes", "lots", "--", "true")
    assert bad.returncode == 2 and "--min-free-bytes" in bad.stderr


# -- the DONE record ----------------------------------------------------------------


@pytest.fixture
def published(tmp_path: Path) -> tuple[Path, str, int, str]:
    """A store with one real generation: (store, generation id, step, manifest digest)."""
    import torch

    import ckptvault as cv

    store = tmp_path / "store"
    with cv.CheckpointManager(store, run_id="run-done") as mgr:
        mgr.save(7, {"w": torch.ones(3), "meta": {"tokens_seen": 1234}})
        (info,) = mgr.generations()
    digest = blake3((Path(info.path) / "manifest.json").read_bytes()).hexdigest()
    return store, info.generation_id, info.step, digest


def done_job(tmp_path: Path, generation_id: str, step: int, digest: str, config: Path) -> list[str]:
    """A job that writes its DONE record through the library, as a trainer would."""
    return child_script(
        tmp_path,
        f"""
        from ckptvault.ops.done import file_digest, write_done_record
        write_done_record(run_id="run-done", step={step}, generation_id={generation_id!r},
                          manifest_digest={digest!r}, config_digest=file_digest({str(config)!r}),
                          tokens=1234)
        """,
    )


def test_done_record_checked_against_config_tokens_and_store(tmp_path: Path, published) -> None:
    store, generation_id, step, digest = published
    config = tmp_path / "config.yaml"
    config.write_text("lr: 3\n")
    cmd = done_job(tmp_path, generation_id, step, digest, config)
    checks = ["--config", str(config), "--store", str(store)]
    good = supervise(*checks, "--expect-tokens", "1234", "--", *cmd)
    assert good.returncode == 0, good.stderr
    assert "DONE record mismatch" not in good.stderr

    wrong_tokens = supervise(*checks, "--expect-tokens", "999", "--", *cmd)
    assert wrong_tokens.returncode == DONE_MISMATCH
    assert "counts 1234 tokens, expected 999" in wrong_tokens.stderr

    other = tmp_path / "other.yaml"
    other.write_text("lr: 4\n")
    wrong_config = supervise("--config", str(other), "--", *cmd)
    assert wrong_config.returncode == DONE_MISMATCH
    assert "another config" in wrong_config.stderr
    assert starts(tmp_path) == 3  # a job that finished is never restarted


def test_done_record_naming_a_missing_or_changed_generation_fails(
    tmp_path: Path, published
) -> None:
    store, generation_id, step, digest = published
    config = tmp_path / "config.yaml"
    config.write_text("lr: 3\n")
    wrong_digest = done_job(tmp_path, generation_id, step, "0" * 64, config)
    result = supervise("--store", str(store), "--expect-tokens", "1234", "--", *wrong_digest)
    assert result.returncode == DONE_MISMATCH
    assert "manifest digest" in result.stderr

    missing = done_job(tmp_path, "20990101T000000.000000Z-deadbeef", step, digest, config)
    result = supervise("--store", str(store), "--expect-tokens", "1234", "--", *missing)
    assert result.returncode == DONE_MISMATCH
    assert "does not list" in result.stderr


def test_a_required_done_record_that_is_missing_or_stale_fails(tmp_path: Path) -> None:
    done = tmp_path / "DONE.json"
    cmd = child_script(tmp_path, "sys.exit(0)")
    result = supervise("--done-file", str(done), "--", *cmd)
    assert result.returncode == DONE_MISMATCH
    assert "without writing a DONE record" in result.stderr

    # A record left by an earlier run (another supervise id) is not this run's.
    digests = {"manifest_digest": "a" * 64, "config_digest": "b" * 64}
    write_done_record(done, run_id="r", step=1, generation_id="g", tokens=5, **digests)
    result = supervise("--done-file", str(done), "--expect-tokens", "5", "--", *cmd)
    assert result.returncode == DONE_MISMATCH
    assert "stale" in result.stderr


def test_done_record_library_round_trip(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(DONE_FILE_ENV, raising=False)
    fields = dict(run_id="r", step=3, generation_id="g", tokens=10)
    fields.update(manifest_digest="a" * 64, config_digest="b" * 64)
    assert write_done_record(**fields) is None  # not supervised: nothing to write
    target = tmp_path / "done.json"
    monkeypatch.setenv(DONE_FILE_ENV, str(target))
    assert write_done_record(**fields) == target
    record = read_done_record(target)
    assert (record.step, record.tokens, record.config_digest) == (3, 10, "b" * 64)
    assert check_done_record(record, config_digest="b" * 64, expect_tokens=10) == []
    assert len(check_done_record(record, config_digest="c" * 64, expect_tokens=11)) == 2
    with pytest.raises(UsageError):
        write_done_record(target, **{**fields, "manifest_digest": "short"})
    target.write_text('{"kind": "something else"}')
    with pytest.raises(FormatError):
        read_done_record(target)


def test_child_sees_the_done_file_path(tmp_path: Path) -> None:
    seen = tmp_path / "seen"
    cmd = child_script(tmp_path, f"Path({str(seen)!r}).write_text(os.environ[{DONE_FILE_ENV!r}])")
    result = supervise("--", *cmd)
    path = Path(seen.read_text())  # in a per-run temporary directory, removed after
    assert (result.returncode, path.name, path.parent.exists()) == (0, "DONE.json", False)
