"""What background saves cost a pure-Python training loop: thread against process.

The loop is interpreter-bound (no torch ops, which release the GIL): fixed chunks of
integer arithmetic, between which it starts a new asynchronous save as soon as the
previous one finished — saving back to back, the worst case for the loop. Each
contender runs in a fresh interpreter, in rotated order, ``--reps`` times:

- **none**: the same loop, no saves (the baseline);
- **thread**: ``async_mode="thread"`` (the writer is a thread of this process);
- **process**: ``async_mode="process"`` (a writer process; only the staging copy
  runs here).

The state is many small-to-medium tensors (``--tensors`` of ``--size-mb`` in all),
where ckptvault's per-tensor Python work (planning, manifest) is largest. Reported:
the loop's slowdown against the baseline of the same repetition (paired), medians
and best runs, and saves completed per second of loop. The store is on tmpfs
(``/dev/shm``) unless ``--disk``: the disk would hide the software's share.

    python -m bench.writer_process --size-mb 256 --tensors 400 --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.measure import rotated

MODES = ("none", "thread", "process")


def loop_chunk(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += (i * i) % 7
    return total


def run_one(mode: str, size_mb: int, tensors: int, chunks: int, store: Path) -> dict:
    """One contender in this interpreter: the loop's seconds and saves completed."""
    import torch

    import ckptvault as cv

    per = max(1, size_mb * 2**20 // 4 // tensors)
    state = {f"t{i:04d}": torch.randn(per) for i in range(tensors)}
    mgr = None
    if mode != "none":
        mgr = cv.CheckpointManager(
            store,
            run_id="bench",
            async_save=True,
            async_mode=mode,
            retention=cv.Retention(keep_last=2, delete_delay=0),
        )
        mgr.prepare(state, wait=True)
        mgr.save(0, state).result()  # the writer (thread or process) is up
    loop_chunk(200_000)  # warm
    handle, step, completed = None, 0, 0
    started = time.perf_counter()
    for _ in range(chunks):
        loop_chunk(100_000)
        if mgr is not None and (handle is None or handle.done()):
            if handle is not None:
                handle.result()
                completed += 1
            step += 1
            handle = mgr.save(step, state)
    seconds = time.perf_counter() - started
    if mgr is not None:
        mgr.close()
    return {"mode": mode, "seconds": seconds, "saves": completed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=256)
    parser.add_argument("--tensors", type=int, default=400)
    parser.add_argument("--chunks", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--disk", action="store_true", help="store on disk, not tmpfs")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one contender
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = run_one(args.one, args.size_mb, args.tensors, args.chunks, Path(args.store))
        print(json.dumps(result))
        return
    root = Path(tempfile.mkdtemp(dir=None if args.disk else "/dev/shm", prefix="ckv-bench-"))
    rows: dict[str, list[float]] = {m: [] for m in MODES}
    saves: dict[str, list[float]] = {m: [] for m in MODES}
    try:
        for _ in range(args.reps):
            for mode in rotated(MODES):
                store = root / f"store-{mode}"
                shutil.rmtree(store, ignore_errors=True)
                out = subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "bench.writer_process",
                        "--one",
                        mode,
                        "--store",
                        str(store),
                        "--size-mb",
                        str(args.size_mb),
                        "--tensors",
                        str(args.tensors),
                        "--chunks",
                        str(args.chunks),
                    ],
                    capture_output=True,
                    text=True,
                    check=True,
                    env={**os.environ, "PYTHONWARNINGS": "ignore"},
                )
                result = json.loads(out.stdout.strip().splitlines()[-1])
                rows[mode].append(result["seconds"])
                saves[mode].append(result["saves"] / result["seconds"])
                shutil.rmtree(store, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(rows, saves, args)


def report(
    rows: dict[str, list[float]], saves: dict[str, list[float]], args: argparse.Namespace
) -> None:
    base = rows["none"]
    where = "disk" if args.disk else "tmpfs"
    print(
        f"\n### A pure-Python loop during back-to-back background saves "
        f"({args.size_mb} MB in {args.tensors} tensors, store on {where}, {args.reps} reps)\n"
    )
    print("| writer | loop seconds (median) | slowdown, paired median | best | saves/s |")
    print("|---|---:|---:|---:|---:|")
    for mode in MODES:
        slow = [t / b - 1 for t, b in zip(rows[mode], base, strict=True)]
        rate = f"{statistics.median(saves[mode]):.2f}" if mode != "none" else "—"
        print(
            f"| {mode} | {statistics.median(rows[mode]):.2f} | "
            f"{100 * statistics.median(slow):+.1f}% | {100 * min(slow):+.1f}% | {rate} |"
        )


if __name__ == "__main__":
    main()
