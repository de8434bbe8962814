"""Child processes of the crash drills (``python -m ckptvault.ops.drills.worker``).

``save-loop STORE ...``: saves generations of a run forever, printing ``begin STEP``
before each ``save`` and ``published STEP SECONDS`` after it returns; the SIGKILL
drill kills it in the middle of a save.

``train STORE MARKS ...``: the supervised drills' tiny training script. It appends
one JSON line per milestone (``imported``, ``restored``, ``step``, ``failing``,
``done``) with ``time.time()`` to MARKS. Attempt 1 (``CKPTVAULT_ATTEMPT``, set by
``ckptvault supervise``) saves two steps and then SIGKILLs itself (``--fail hang``:
deadlocks instead, two threads taking two locks in opposite orders, for the hang
watchdog to find); later attempts restore, train and exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ckptvault.events import Event, Restored
from ckptvault.manager import CheckpointManager
from ckptvault.ops.drills.synthetic import ballast_state, build_state, train_step


def _manager(args: argparse.Namespace) -> CheckpointManager:
    options: dict[str, Any] = {"run_id": args.run_id, "ledger": args.ledger, "catalog": False}
    options["audit_log"] = Path(args.ledger).with_suffix(".audit")
    if args.keystore:
        options["keystore"] = args.keystore
    if args.signing_key:
        options["signing_key"] = args.signing_key
    return CheckpointManager(args.store, **options)


def save_loop(args: argparse.Namespace) -> None:
    state = build_state(seed=3) if args.ballast is None else ballast_state(args.ballast)
    with _manager(args) as manager:
        step = args.start
        while True:
            print(f"begin {step}", flush=True)
            started = time.perf_counter()
            manager.save(step, state)
            print(f"published {step} {time.perf_counter() - started:.6f}", flush=True)
            step += 1


def _mark(path: Path, what: str, **fields: Any) -> None:
    with open(path, "a", encoding="utf-8") as marks:
        marks.write(json.dumps({"mark": what, "at": time.time(), **fields}) + "\n")


def train(args: argparse.Namespace) -> None:
    marks = Path(args.marks)
    attempt = int(os.environ.get("CKPTVAULT_ATTEMPT", "1"))
    _mark(marks, "imported", attempt=attempt)
    state = build_state(seed=0)
    events: list[Event] = []
    with _manager(args) as manager:
        manager.events.subscribe(events.append)
        info = manager.restore(state)
        stages = next((dict(e.stages) for e in events if isinstance(e, Restored)), {})
        _mark(marks, "restored", attempt=attempt, step=info.step if info else None, stages=stages)
        start = info.step + 1 if info is not None else 0
        for step in range(start, start + 3):
            train_step(state)
            _mark(marks, "step", attempt=attempt, step=step)
            manager.save(step, state)
            if attempt == 1 and step == start + 1:
                _mark(marks, "failing", attempt=attempt, step=step)
                if args.fail == "hang":
                    _deadlock()
                os.kill(os.getpid(), signal.SIGKILL)
    _mark(marks, "done", attempt=attempt)


def _deadlock() -> None:
    """Never returns: two threads each hold one lock and wait for the other's."""
    first, second = threading.Lock(), threading.Lock()
    both_hold = threading.Barrier(2)

    def take(mine: threading.Lock, theirs: threading.Lock) -> None:
        with mine:
            both_hold.wait()
            with theirs:
                pass

    threads = [threading.Thread(target=take, args=p) for p in ((first, second), (second, first))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ckptvault.ops.drills.worker")
    parser.add_argument("command", choices=["save-loop", "train"])
    parser.add_argument("store")
    parser.add_argument("marks", nargs="?")
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--ledger", required=True)
    parser.add_argument("--keystore")
    parser.add_argument("--signing-key")
    parser.add_argument("--start", type=int, default=0)
    parser.add_argument("--ballast", type=int, help="save a plain state of this many bytes")
    parser.add_argument("--fail", choices=["kill", "hang"], default="kill")
    args = parser.parse_args(argv)
    if args.command == "save-loop":
        save_loop(args)
    else:
        train(args)


if __name__ == "__main__":
    main(sys.argv[1:])
