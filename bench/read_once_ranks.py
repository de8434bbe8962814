"""Read-once restores at 4 ranks of DDP: bytes read from storage per rank, and time.

    python -m bench.read_once_ranks --size-mb 1024 [--reps 3] [--cold] [--dir bench-out/read-once]

Four gloo ranks on 127.0.0.1 hold ``--size-mb`` MB of replicated state (plain
tensors every rank holds whole, as DDP does), save it once, then restore it in a new
4-rank job, interleaved over ``--reps`` with the order rotated:

- every rank reads alone (``CKPTVAULT_READ_ONCE=0``: each reads every replicated
  byte it needs itself, the path before read-once);
- read-once (the default): each shared digest chunk is read by one rank and sent to
  the others, which verify it against the manifest's digest.

Bytes read are each rank's ``rchar`` (``/proc/self/io``: what it passed to read()
and pread(), page cache or disk; gloo's sockets use recv, which it does not count)
around ``restore()``. Time is the slowest rank's ``restore()``. ``--cold`` drops the
page cache before each restore (as root), otherwise the store is page-cached. Also
prints BLAKE3's speed on this machine, what a receiver's check of the bytes it is
sent costs. Prints Markdown tables: per-rank MB, total over the checkpoint's size
(goal <= 1.1), seconds (median, best) and the paired ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench.measure import drop_caches, quiesce, rotated

WORLD = 4
GOAL = 1.1
TENSORS = 16


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(mode: str, work: Path, size_mb: float, read_once: bool) -> list[dict[str, float]]:
    port = _free_port()
    procs = []
    for rank in range(WORLD):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(WORLD),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            CKPTVAULT_READ_ONCE="1" if read_once else "0",
        )
        argv = [sys.executable, "-m", "bench.read_once_ranks", "--worker", mode]
        argv += ["--dir", str(work), "--size-mb", str(size_mb)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"a rank of {mode} failed ({proc.returncode})")
        reports.append(json.loads(out.splitlines()[-1]))
    return reports


def _rchar() -> int:
    with open("/proc/self/io") as stats:
        for line in stats:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def _worker(mode: str, work: Path, size_mb: float) -> None:
    import torch
    import torch.distributed as dist

    import ckptvault as cv

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    elements = int(size_mb * 1e6 / 4 / TENSORS)
    torch.manual_seed(0)  # the same replicated values on every rank
    fill = torch.randn if mode == "save" else torch.zeros
    state = {"model": {f"w{i}": fill(elements) for i in range(TENSORS)}}
    with cv.CheckpointManager(
        work / "store", run_id="bench", catalog=False, collective_timeout_s=900
    ) as mgr:
        before, began = _rchar(), time.perf_counter()
        if mode == "save":
            mgr.save(1, state, blocking=True)
            size = 0
        else:
            info = mgr.restore(state)
            assert info is not None
            size = info.bytes
        seconds, read = time.perf_counter() - began, _rchar() - before
    print(json.dumps({"seconds": seconds, "read": read, "bytes": size}))
    dist.destroy_process_group()


def _blake3_speed() -> float:
    """GB/s of BLAKE3 over 4 MiB blocks on one core: what a receiver's check costs."""
    from blake3 import blake3

    block = os.urandom(4 << 20)
    started = time.perf_counter()
    for _ in range(64):
        blake3(block).digest()
    return 64 * len(block) / (time.perf_counter() - started) / 1e9


def _table(results: dict[str, list[list[dict[str, float]]]], ckpt: int) -> list[str]:
    lines = [
        "| every rank | MB read per rank (rank 0..3, median) | total / checkpoint | goal | "
        "restore s, median (best) |",
        "|---|---|---|---|---|",
    ]
    for case, runs in results.items():
        per_rank = [statistics.median(run[r]["read"] for run in runs) / 1e6 for r in range(WORLD)]
        ratio = sum(per_rank) * 1e6 / ckpt
        slowest = [max(r["seconds"] for r in run) for run in runs]
        goal = f"<= {GOAL}: {'met' if ratio <= GOAL else 'not met'}" if case == "read-once" else ""
        lines.append(
            f"| {case} | {' / '.join(f'{mb:.0f}' for mb in per_rank)} | {ratio:.2f}x | {goal} | "
            f"{statistics.median(slowest):.2f} ({min(slowest):.2f}) |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="drop the page cache first")
    parser.add_argument("--dir", type=Path, default=Path("bench-out/read-once"))
    parser.add_argument("--worker")
    args = parser.parse_args()
    work = args.dir.resolve()
    if args.worker:
        _worker(args.worker, work, args.size_mb)
        return
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        _launch("save", work, args.size_mb, True)
        cases = {"reads alone": False, "read-once": True}
        results: dict[str, list[list[dict[str, float]]]] = {case: [] for case in cases}
        ratios = []
        for _ in range(args.reps):
            paired = {}
            for case in rotated(list(cases)):
                drop_caches(work / "store") if args.cold else quiesce()
                reports = _launch("restore", work, args.size_mb, cases[case])
                results[case].append(reports)
                paired[case] = max(r["seconds"] for r in reports)
            ratios.append(paired["read-once"] / paired["reads alone"])
        ckpt = int(results["read-once"][0][0]["bytes"])
        cache = "cold (page cache dropped)" if args.cold else "page-cached"
        print(f"\n4 gloo ranks, DDP: {ckpt / 1e6:.0f} MB replicated, {cache}, {args.reps} reps\n")
        print("\n".join(_table(results, ckpt)))
        print(
            f"\nread-once / reads alone, restore seconds (paired): median "
            f"{statistics.median(ratios):.2f}x, best {min(ratios):.2f}x"
        )
        speed = _blake3_speed()
        print(
            f"BLAKE3 on one core: {speed:.1f} GB/s: a receiver's check of what it is sent "
            f"costs {1 / speed:.2f} s per GB received"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
