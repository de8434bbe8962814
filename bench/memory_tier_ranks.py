"""Recovery at 4 ranks on 2 simulated nodes: from memory, from a peer, from the store.

    python -m bench.memory_tier_ranks --size-gb 1 [--reps 3] [--dir bench-out/memory-ranks]

Four gloo ranks on 127.0.0.1 stand for two nodes (``CKPTVAULT_NODE``: ranks 0-1 on
A, 2-3 on B), each holding a quarter of ``--size-gb`` GB of sharded weights
(DTensors, as FSDP holds them). One save goes into the memory tier (each node's
directory under ``/dev/shm``, ``peers=1``) and, verified, into a POSIX store. Then,
interleaved over ``--reps`` with the order rotated, a new 4-rank job restores:

- from memory: both nodes' directories intact;
- from a peer: node B's directory lost (its ranks fetch the generation from A);
- from the store: both lost, the store's pages dropped first.

Each figure is from the launch of the 4 processes to the last rank's state applied
(imports and process start included), and the ``restore()`` call alone (the slowest
rank's). Prints a Markdown table: medians, best runs, and the ratio to the store.
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
GOAL = 0.25
TENSORS = 8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _launch(mode: str, work: Path, size_gb: float) -> list[dict[str, float | str]]:
    port = _free_port()
    started = time.time()
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
            CKPTVAULT_NODE="A" if rank < 2 else "B",
        )
        argv = [sys.executable, "-m", "bench.memory_tier_ranks", "--worker", mode]
        argv += ["--dir", str(work), "--size-gb", str(size_gb), "--started", repr(started)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    reports = []
    for proc in procs:
        out, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"a rank of {mode} failed ({proc.returncode})")
        reports.append(json.loads(out.splitlines()[-1]))
    return reports


def _worker(mode: str, work: Path, size_gb: float, started: float) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import ckptvault as cv

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    rows = int(size_gb * 1e9 / 4 / TENSORS / 4096) // WORLD * WORLD
    shape = (rows, 4096)
    fill = torch.randn if mode == "save" else torch.zeros
    torch.manual_seed(rank)
    local = [fill(rows // WORLD, 4096) for _ in range(TENSORS)]
    state = {
        "model": {
            f"w{i}": DTensor.from_local(
                t, mesh, [Shard(0)], run_check=False, shape=shape, stride=(4096, 1)
            )
            for i, t in enumerate(local)
        }
    }
    node = os.environ["CKPTVAULT_NODE"]
    tier = cv.MemoryTier(path=f"/dev/shm/ckptvault-bench-ranks/{node}", keep=1, durable_every=1)
    with cv.CheckpointManager(
        work / "store", run_id="bench", memory_tier=tier, catalog=False, collective_timeout_s=600
    ) as mgr:
        began = time.time()
        if mode == "save":
            mgr.save(1, state, blocking=True)
            source = "saved"
        else:
            info = mgr.restore(state)
            assert info is not None
            source = info.source
        done = time.time()
    print(json.dumps({"total": done - started, "call": done - began, "source": source}))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("bench-out/memory-ranks"))
    parser.add_argument("--worker")
    parser.add_argument("--started", type=float)
    args = parser.parse_args()
    work = args.dir.resolve()
    if args.worker:
        _worker(args.worker, work, args.size_gb, args.started)
        return
    memory = Path("/dev/shm/ckptvault-bench-ranks")
    backup = Path("/dev/shm/ckptvault-bench-ranks-backup")
    for path in (work, memory, backup):
        shutil.rmtree(path, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        _launch("save", work, args.size_gb)
        shutil.copytree(memory, backup, symlinks=True)
        results: dict[str, list[tuple[float, float]]] = {}
        cases = ["memory", "peer", "store, cold"]
        for _ in range(args.reps):
            for case in rotated(cases):
                shutil.rmtree(memory, ignore_errors=True)
                shutil.copytree(backup, memory, symlinks=True)
                if case == "peer":
                    shutil.rmtree(memory / "B")
                if case == "store, cold":
                    shutil.rmtree(memory)
                    drop_caches(work / "store")
                else:
                    quiesce()
                reports = _launch("restore", work, args.size_gb)
                expected = {"memory": {"memory"}, "peer": {"memory", "peer"}}.get(case, {"store"})
                assert {str(r["source"]) for r in reports} == expected, (case, reports)
                slowest = (
                    max(float(r["total"]) for r in reports),
                    max(float(r["call"]) for r in reports),
                )
                results.setdefault(case, []).append(slowest)
    finally:
        for path in (memory, backup, work):
            shutil.rmtree(path, ignore_errors=True)
    _report(results, args.size_gb)


def _report(results: dict[str, list[tuple[float, float]]], size_gb: float) -> None:
    store = results["store, cold"]
    print(
        f"| {size_gb:g} GB over 4 ranks, 2 nodes | to applied, median s | best s | restore() median s | best s | vs store (restore(), best) |"
    )
    print("|---|---|---|---|---|---|")
    for case in ("memory", "peer", "store, cold"):
        totals = [t for t, _ in results[case]]
        calls = [c for _, c in results[case]]
        ratio = "" if case == "store, cold" else f"{min(calls) / min(c for _, c in store):.2f}x"
        print(
            f"| {case} | {statistics.median(totals):.2f} | {min(totals):.2f} | "
            f"{statistics.median(calls):.2f} | {min(calls):.2f} | {ratio} |"
        )


if __name__ == "__main__":
    main()
