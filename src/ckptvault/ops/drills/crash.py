"""Drills with real processes: SIGKILL in the middle of a save, and a supervised
restart measured from the failure to the first step of the resumed run.

- sigkill-mid-save: a child process saves generations in a loop into the copy; it
  is killed with SIGKILL early (a tenth of the way) through a save (timed from the
  duration of the one before). Restore must then take the newest *complete* generation without
  skipping anything: a save cut short never became visible (atomic publish).
- supervised-restart: ``ckptvault supervise --max-restarts 1 --backoff 0`` runs a
  tiny training script on a scratch run of its own; attempt 1 saves two steps and
  SIGKILLs itself. Measured from the script's marks and the supervisor's attempt
  log: detection (failure to the supervisor seeing the exit), launch (to the new
  process having imported ckptvault), restore (building the model and restoring,
  with its stages), first step, and ``recovery`` (failure to first step).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import IO

from ckptvault.ops.drills.base import Drill, timed_restore
from ckptvault.ops.drills.context import DrillContext
from ckptvault.ops.drills.supervised import CHILD_TIMEOUT_S, WORKER, run_supervised

Outcome = tuple[bool, str, dict[str, float]]
KILL_AT = 0.1  # fraction of a save's duration: early, while its tensor files are written


def _worker_options(context: DrillContext, ledger: Path) -> list[str]:
    options = ["--run-id", context.run_id, "--ledger", str(ledger)]
    if context.keystore is not None:
        options += ["--keystore", str(context.keystore)]
    if context.signing_key is not None:
        options += ["--signing-key", str(context.signing_key)]
    if not context.synthetic:
        options += ["--ballast", str(min(max(context.bytes_per_generation, 1 << 20), 64 << 20))]
    return options


def _kill_mid_save(child: subprocess.Popen[str], stdout: IO[str]) -> tuple[list[int], int]:
    """Read the save loop's lines; once two saves were published, SIGKILL it a
    tenth of the way through the next one (timed from the last save's duration).
    Returns every step reported published (read to the end) and the step being
    saved when killed."""
    published: list[int] = []
    last_save_s = 0.0
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    begun: int | None = None
    while time.monotonic() < deadline:
        words = stdout.readline().split()
        if not words:
            break  # the child exited
        if words[0] == "published":
            published.append(int(words[1]))
            last_save_s = float(words[2])
        elif words[0] == "begin":
            begun = int(words[1])
            if len(published) >= 2:
                time.sleep(last_save_s * KILL_AT)
                child.kill()
                break
    else:
        child.kill()
    child.wait()
    for line in stdout:  # what it printed before the kill landed
        words = line.split()
        if words[:1] == ["published"]:
            published.append(int(words[1]))
        elif words[:1] == ["begin"]:
            begun = int(words[1])
    if len(published) < 2 or begun is None:
        raise RuntimeError(f"the save loop stopped early (exit {child.returncode})")
    return published, begun


def _sigkill_drill(context: DrillContext) -> Outcome:
    label = "sigkill-mid-save"
    store = context.fresh_copy(label)
    newest = context.generations(store)[0]
    command = [*WORKER, "save-loop", str(store), "--start", str(newest.step + 1)]
    command += _worker_options(context, context.workdir(label) / "writer.db")
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert child.stdout is not None
    with child.stdout:
        published, cut = _kill_mid_save(child, child.stdout)
    staging = store / ".staging"
    leftovers = sorted(p.name for p in staging.iterdir()) if staging.exists() else []
    state, strict = context.new_state()
    with context.manager(store, label) as manager:
        outcome = timed_restore(manager, state, strict)
    info = outcome.info
    passed = (
        info is not None
        and outcome.error is None
        # The last save it reported, or the one cut short if it had already published
        # (the kill lands after the rename at times: then it is complete and durable).
        and info.step in (published[-1], cut)
        and not info.skipped
    )
    observed = (
        f"save loop published steps {published[0]}..{published[-1]} and was SIGKILLed "
        f"{'while saving' if cut not in published else 'after'} step {cut} "
        f"({len(leftovers)} staging leftover(s)); {outcome.describe()}"
    )
    return passed, observed, outcome.timings


def _supervised_drill(context: DrillContext) -> Outcome:
    run = run_supervised(context, "supervised-restart", "kill", [])
    passed = run.resumed_after_one_failure() and run.first_attempt("signal") == "SIGKILL"
    failed_at = run.failed_at
    observed = (
        f"supervise exited {run.returncode} after {len(run.attempts)} attempt(s); attempt 1 "
        f"killed by {run.first_attempt('signal')} after saving step "
        f"{failed_at[0] if failed_at else '?'}; {run.describe_resume()}"
    )
    return passed, observed, run.timings() if passed else {}


CRASH_DRILLS = [
    Drill(
        "sigkill-mid-save",
        "a save killed with SIGKILL is never visible: restore takes the newest complete "
        "generation, skipping nothing",
        _sigkill_drill,
    ),
    Drill(
        "supervised-restart",
        "ckptvault supervise restarts the killed job; it restores its last save and trains on",
        _supervised_drill,
    ),
]
