"""``ckptvault supervise``: run a training command, restart it after a failure, bounded.

The policy is the pure function :func:`decide`; :class:`Supervisor` runs the child
and applies it. In short (seed 004's reference policy):

- exit 0 is success; the job's DONE record, when there is one, is checked;
- ``PREEMPTED`` (75): the job saved a final checkpoint after a scheduler's signal;
  it is started again at once and does not use the restart budget (a separate limit,
  ``max_preemptions``, stops a job preempted in a loop);
- a code in ``PERMANENT`` (78) stops at once: starting again cannot help;
- any other code, death by a signal, or a refused disk-space preflight is a failure:
  wait for the backoff and start again while the budget (``1 + max_restarts``
  attempts) lasts, then give up with the child's last code;
- SIGTERM/SIGINT to the supervisor is forwarded to the child's process group and
  never restarts; a stop file present before a start or when the child exits means
  "do not start again";
- with a hang watchdog (``hang``: :mod:`ckptvault.ops.hang`), a job whose progress
  stops gets SIGTERM, then SIGKILL after the grace period, and the attempt is a
  ``hang``: a failure, restarted within the same budget.

It only reads the store (free space, the DONE record's generation), never deletes.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ckptvault.errors import UsageError
from ckptvault.exit_codes import PERMANENT, PREEMPTED
from ckptvault.observe.heartbeat import PROGRESS_DIR_ENV
from ckptvault.ops.done import DONE_FILE_ENV, SUPERVISE_ID_ENV, DoneExpectation
from ckptvault.ops.hang import HangPolicy, HangWatch, IntervalHistory

# The supervisor's own exit codes (besides 0 and the child's code it passes on).
DONE_MISMATCH = 65  # EX_DATAERR: exit 0, but the DONE record is missing or wrong
NO_SPACE = 74  # EX_IOERR: the disk-space preflight never passed within the budget
CANNOT_EXECUTE = 126  # the command exists but cannot be executed (shell convention)
NOT_FOUND = 127  # the command was not found (shell convention)
ATTEMPT_ENV = "CKPTVAULT_ATTEMPT"  # 1-based attempt number, for the child's logs
POLL_S = 0.05  # how often waits look at signals, stop file and child


def signal_exit_code(signum: int) -> int:
    """The shell's status for death by ``signum``: 128 + N (SIGTERM: 143)."""
    return 128 + signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


@dataclass(frozen=True)
class Policy:
    """Restart policy. ``max_restarts`` failures are retried: at most
    ``1 + max_restarts`` attempts (default 2 restarts: 3 attempts, as in seed 004);
    preemptions do not count but are bounded by ``max_preemptions``. ``backoff_s[i]``
    is the wait after failure ``i + 1``; the last value repeats. ``grace_s``: how long a cancelled child
    may take to exit before it is killed."""

    max_restarts: int = 2
    backoff_s: tuple[float, ...] = (10.0, 20.0, 40.0)
    max_preemptions: int = 100
    grace_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.max_preemptions < 0:
            raise UsageError("--max-restarts and --max-preemptions must be 0 or more")
        if not self.backoff_s or any(not 0 <= s < float("inf") for s in self.backoff_s):
            raise UsageError("--backoff needs one or more finite waits of 0 seconds or more")
        if not 0 <= self.grace_s < float("inf"):
            raise UsageError("--grace-seconds must be 0 or more")

    def backoff_after(self, failures: int) -> float:
        """The wait after the ``failures``-th failure (1-based)."""
        return self.backoff_s[min(failures, len(self.backoff_s)) - 1]


class Action(str, Enum):
    FINISH = "finish"  # the job succeeded: exit 0 (after the DONE check)
    RESTART = "restart"  # start the job again after ``delay_s``
    STOP = "stop"  # do not start again: exit with ``exit_code``


@dataclass(frozen=True)
class Outcome:
    """How one attempt ended: ``returncode`` as ``subprocess`` reports it (negative:
    killed by that signal), or None when the child was not started, with ``refused``
    saying why (the preflight), or ``spawn_error`` (126/127) when it could not be.
    ``hung``: why the hang watchdog stopped it (then the code is how it died)."""

    returncode: int | None = None
    refused: str | None = None
    spawn_error: int | None = None
    hung: str | None = None


@dataclass(frozen=True)
class Decision:
    """What to do after an attempt; ``kind`` names the case for logs and tests."""

    action: Action
    kind: str  # success|preempted|permanent|failure|hang|refused|cancelled|stopped|...
    exit_code: int = 0  # the supervisor's exit status unless action is RESTART
    delay_s: float = 0.0
    reason: str = ""


def decide(
    outcome: Outcome,
    *,
    failures: int,
    preemptions: int,
    policy: Policy,
    cancelled_by: int | None = None,
    stop_file: bool = False,
) -> Decision:
    """The policy: what follows ``outcome``, given the failures and preemptions before
    it. Pure: no clock, no process, no file."""
    if outcome.spawn_error is not None:
        return Decision(Action.STOP, "spawn_error", outcome.spawn_error, reason="cannot start")
    code = _status(outcome)
    if cancelled_by is not None:
        why = f"cancelled by {signal_name(cancelled_by)}: not restarting"
        return Decision(Action.STOP, "cancelled", signal_exit_code(cancelled_by), reason=why)
    if outcome.returncode == 0:
        return Decision(Action.FINISH, "success", 0, reason="the job succeeded")
    if outcome.returncode in PERMANENT:
        why = f"exit {code} is permanent: starting again cannot help"
        return Decision(Action.STOP, "permanent", code, reason=why)
    if stop_file:
        return Decision(Action.STOP, "stopped", code, reason="stopped by stop file")
    if outcome.hung is not None:  # whatever it exited with after the watchdog's SIGTERM
        return _failure(outcome, "hang", failures, policy, f"hung: {outcome.hung}; ")
    if outcome.returncode == PREEMPTED:
        if preemptions + 1 > policy.max_preemptions:
            why = f"preempted {preemptions + 1} times, over --max-preemptions {policy.max_preemptions}"
            return Decision(Action.STOP, "preemption_limit", code, reason=why)
        return Decision(Action.RESTART, "preempted", reason="preempted: starting again at once")
    kind = "refused" if outcome.returncode is None else "failure"
    return _failure(outcome, kind, failures, policy)


def _failure(
    outcome: Outcome, kind: str, failures: int, policy: Policy, prefix: str = ""
) -> Decision:
    """A failed attempt: restart after the backoff while the budget lasts."""
    if failures + 1 > policy.max_restarts:
        why = (
            f"giving up after {failures + 1} failed attempts (--max-restarts {policy.max_restarts})"
        )
        return Decision(Action.STOP, kind, _status(outcome), reason=prefix + why + _detail(outcome))
    delay = policy.backoff_after(failures + 1)
    return Decision(Action.RESTART, kind, delay_s=delay, reason=f"{prefix}restart in {delay:g} s")


def _detail(outcome: Outcome) -> str:
    return f"; the last was refused: {outcome.refused}" if outcome.refused else ""


def _status(outcome: Outcome) -> int:
    """The exit status an attempt passes on: its code, 128+N for signal N, or NO_SPACE
    for a start the preflight refused."""
    if outcome.returncode is None:
        return NO_SPACE
    if outcome.returncode < 0:
        return signal_exit_code(-outcome.returncode)
    return outcome.returncode


def describe(returncode: int) -> str:
    """``exit N`` or ``killed by SIGNAME``, for logs."""
    return f"killed by {signal_name(-returncode)}" if returncode < 0 else f"exit {returncode}"


class _Signals:
    """SIGTERM/SIGINT handlers for the supervisor's lifetime: remember the first
    signal and forward each to the running child's process group."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.received_at = 0.0
        self.child: subprocess.Popen[bytes] | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        # Handlers can only be set from the main thread; elsewhere (a library caller's
        # worker thread) the supervisor runs without cancellation.
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received, self.received_at = signum, time.monotonic()
        self.forward(signum)

    def forward(self, signum: int) -> None:
        if self.child is not None and self.child.returncode is None:
            # The child leads its own process group: the whole job gets the signal.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.child.pid, signum)

    def sleep(self, seconds: float) -> bool:
        """Wait ``seconds``; False as soon as a signal cancels the wait."""
        deadline = time.monotonic() + seconds
        while self.received is None and time.monotonic() < deadline:
            time.sleep(min(POLL_S, max(0.0, deadline - time.monotonic())))
        return self.received is None


@dataclass
class Supervisor:
    """Runs ``command`` under ``policy``; :meth:`run` returns the exit status.

    ``preflight`` returns why the child must not start now (None: it may);
    ``log_path`` gets one JSON object per attempt, and one for the exit.
    """

    command: list[str]
    policy: Policy = field(default_factory=Policy)
    stop_file: Path | None = None
    preflight: Callable[[], str | None] | None = None
    log_path: Path | None = None
    done: DoneExpectation | None = None
    emit: Callable[[str], None] = field(
        default=lambda line: print(f"ckptvault supervise: {line}", file=sys.stderr, flush=True)
    )
    supervise_id: str = field(default_factory=lambda: secrets.token_hex(8))
    # Also told every attempt and the exit (e.g. the catalog: ``catalog_attempts``).
    record: Callable[[dict[str, Any]], None] | None = None
    # The job's memory tier on this node: each attempt's record says the newest step
    # it holds, what a restart here recovers from memory (None: not watched).
    memory_path: Path | None = None
    # The hang watchdog (None: off) and the directory under which each attempt gets
    # its own progress directory (required with ``hang``).
    hang: HangPolicy | None = None
    progress_root: Path | None = None
    _intervals: IntervalHistory = field(default_factory=IntervalHistory, init=False)

    def run(self) -> int:
        """Supervise until success, a stop, give-up or cancellation; the exit status."""
        if not self.command:
            raise UsageError("no command to supervise: give it after --, e.g. -- python train.py")
        with _Signals() as signals:
            return self._loop(signals)

    def _loop(self, signals: _Signals) -> int:
        failures = preemptions = attempt = last_code = 0
        while True:
            if signals.received is not None:
                return self._exit(signal_exit_code(signals.received), "cancelled before a start")
            if self._stop_requested():
                return self._exit(last_code, "stopped by stop file: not starting again")
            attempt += 1
            started = time.time()
            outcome, pid = self._attempt(attempt, signals)
            decision = decide(
                outcome,
                failures=failures,
                preemptions=preemptions,
                policy=self.policy,
                cancelled_by=signals.received,
                stop_file=self._stop_requested(),
            )
            if decision.action is Action.FINISH:
                decision = self._check_done(decision)
            self._record_attempt(attempt, pid, started, outcome, decision)
            if decision.action is not Action.RESTART:
                return self._exit(decision.exit_code, decision.reason)
            failures += decision.kind != "preempted"
            preemptions += decision.kind == "preempted"
            last_code = _status(outcome)
            if decision.delay_s > 0:
                self.emit(f"backoff: waiting {decision.delay_s:g} s before attempt {attempt + 1}")
            if not signals.sleep(decision.delay_s):
                return self._exit(
                    signal_exit_code(signals.received or signal.SIGTERM),
                    f"cancelled by {signal_name(signals.received or 0)} during backoff",
                )

    def _stop_requested(self) -> bool:
        return self.stop_file is not None and os.path.lexists(self.stop_file)

    def _attempt(self, attempt: int, signals: _Signals) -> tuple[Outcome, int | None]:
        refusal = self.preflight() if self.preflight else None
        if refusal is not None:
            self.emit(f"attempt {attempt}: preflight refused the start: {refusal}")
            return Outcome(refused=refusal), None
        env = {**os.environ, ATTEMPT_ENV: str(attempt), SUPERVISE_ID_ENV: self.supervise_id}
        if self.done is not None:
            env[DONE_FILE_ENV] = str(self.done.path)
        watch = self._hang_watch(attempt, env)
        self.emit(f"attempt {attempt}: start: {shlex.join(self.command)}")
        begun = time.monotonic()
        try:
            # Own session and process group: a terminal's Ctrl-C reaches the supervisor
            # only, and forwarding reaches every process of the job.
            child = subprocess.Popen(self.command, env=env, start_new_session=True)
        except OSError as exc:  # not found (127) or not executable (126), as a shell says
            self.emit(f"attempt {attempt}: cannot start the command: {exc}")
            code = NOT_FOUND if isinstance(exc, FileNotFoundError) else CANNOT_EXECUTE
            return Outcome(spawn_error=code), None
        signals.child = child
        if signals.received is not None:  # cancelled while the child was being started
            signals.forward(signals.received)
        try:
            returncode, hung = self._wait(child, signals, watch)
        finally:
            signals.child = None
        took = time.monotonic() - begun
        self.emit(f"attempt {attempt}: {describe(returncode)} after {took:.1f} s (pid {child.pid})")
        return Outcome(returncode=returncode, hung=hung), child.pid

    def _hang_watch(self, attempt: int, env: dict[str, str]) -> HangWatch | None:
        """A fresh progress directory for this attempt (named to the job in ``env``)
        and its watch; None without a hang watchdog."""
        if self.hang is None:
            return None
        if self.progress_root is None:
            raise UsageError("a hang watchdog needs a progress directory (progress_root)")
        directory = self.progress_root / f"attempt-{attempt}"
        directory.mkdir(mode=0o700, parents=True, exist_ok=False)
        env[PROGRESS_DIR_ENV] = str(directory)
        return HangWatch(directory, self.hang, self._intervals, self.emit)

    def _wait(
        self, child: subprocess.Popen[bytes], signals: _Signals, watch: HangWatch | None
    ) -> tuple[int, str | None]:
        """Wait for the child; once cancelled or found hung, SIGTERM its group and
        SIGKILL it after the grace period. The exit status, and why it hung (None)."""
        killed = False
        hung: str | None = None
        stopped_at = 0.0  # when the watchdog sent SIGTERM
        while True:
            try:
                returncode = child.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if watch is not None and hung is None and signals.received is None:
                hung = watch.check()
                if hung is not None:
                    self.emit(f"hang: {hung}: SIGTERM to the job")
                    signals.forward(signal.SIGTERM)
                    stopped_at = time.monotonic()
            if signals.received is not None:
                overdue = time.monotonic() - signals.received_at > self.policy.grace_s
            else:
                overdue = hung is not None and time.monotonic() - stopped_at > self.policy.grace_s
            if overdue and not killed:
                self.emit(f"the job did not exit within {self.policy.grace_s:g} s: SIGKILL")
                signals.forward(signal.SIGKILL)
                killed = True
        # Processes the job left behind in its group (data-loader workers, say) would
        # run beside the next attempt: end them before anything else starts.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        return returncode, hung

    def _check_done(self, decision: Decision) -> Decision:
        problems = self.done.problems(self.supervise_id) if self.done else []
        for problem in problems:
            self.emit(f"DONE record mismatch: {problem}")
        if not problems:
            return decision
        why = "the DONE record does not match: " + "; ".join(problems)
        return Decision(Action.STOP, "done_mismatch", DONE_MISMATCH, reason=why)

    def _record_attempt(
        self, attempt: int, pid: int | None, started: float, outcome: Outcome, decision: Decision
    ) -> None:
        code = outcome.returncode
        self._log(
            {
                "event": "attempt",
                "attempt": attempt,
                "pid": pid,
                "started_at": started,
                "ended_at": time.time(),
                "exit_code": code if code is not None and code >= 0 else None,
                "signal": signal_name(-code) if code is not None and code < 0 else None,
                "refused": outcome.refused,
                "hung": outcome.hung,
                "decision": decision.action.value,
                "kind": decision.kind,
                "delay_s": decision.delay_s,
                "reason": decision.reason,
                **self._memory(),
            }
        )

    def _memory(self) -> dict[str, Any]:
        """``{"memory_step": N}``: the newest generation of the memory tier watched
        (None when it holds none); nothing when none is watched."""
        if self.memory_path is None:
            return {}
        from ckptvault.format.layout import parse_generation_dirname

        try:
            names = [parse_generation_dirname(entry.name) for entry in os.scandir(self.memory_path)]
        except OSError:
            names = []
        steps = [name.step for name in names if name is not None]
        return {"memory_step": max(steps) if steps else None}

    def _exit(self, code: int, reason: str) -> int:
        self.emit(f"exit {code}: {reason}")
        self._log({"event": "exit", "exit_code": code, "reason": reason, "at": time.time()})
        return code

    def _log(self, record: dict[str, Any]) -> None:
        record = {"supervise_id": self.supervise_id, **record}
        if self.record is not None:
            self.record({**record, "command": shlex.join(self.command)})
        if self.log_path is None:
            return
        # One line per write in append mode: a reader never sees half a record, and
        # runs that share a log file interleave whole lines.
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(json.dumps(record, sort_keys=True) + "\n")
