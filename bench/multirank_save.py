"""Saving a sharded state from several ranks: ckptvault against DCP's FileSystemWriter.

    python -m bench.multirank_save --size-gb 0.5 --ranks 2 --reps 5 [--dir /dev/shm]

Launches ``--ranks`` processes (gloo on 127.0.0.1). Each holds its shards of a state
of about ``--size-gb`` GB in total (DTensors sharded by rows, as FSDP2 holds them)
and, interleaved over ``--reps`` repetitions, saves it with:

- ``DCP FileSystemWriter``: ``dcp.save(state, storage_writer=FileSystemWriter(dir))``
  with its defaults (``sync_files=True``: every file fsync'd), pickled metadata;
- ``ckptvault``: ``CheckpointManager(dir).save(step, state)``, collective: every
  rank's files hashed (BLAKE3 per chunk) and fsync'd, one manifest built, published
  atomically.

A save's time is the slowest rank's, from a barrier before to the end of the call.
Medians and best runs are printed as a Markdown table, with the manifest's size.
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
import tempfile
import time
from pathlib import Path

ROWS = 4096  # each tensor: ROWS x COLS float32, sharded by rows over the ranks


def _worker(size_gb: float, reps: int, root: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import ckptvault as cv

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    cols = 1024
    count = max(1, round(size_gb * 1e9 / (ROWS * cols * 4)))
    torch.manual_seed(0)
    state = {
        f"layer{i}": distribute_tensor(torch.randn(ROWS, cols), mesh, [Shard(0)])
        for i in range(count)
    }
    total = sum(t.numel() * 4 for t in state.values())
    times: dict[str, list[float]] = {"DCP FileSystemWriter": [], "ckptvault": []}
    manifest_bytes = 0

    def timed(save: object) -> float:
        dist.barrier()
        started = time.perf_counter()
        save()  # type: ignore[operator]
        elapsed = torch.tensor([time.perf_counter() - started])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed.item())

    with cv.CheckpointManager(Path(root, "vault"), run_id="bench") as manager:
        for rep in range(reps):
            order = list(times) if rep % 2 == 0 else list(reversed(times))
            for name in order:
                if name == "ckptvault":
                    times[name].append(timed(lambda r=rep: manager.save(r + 1, state)))
                else:
                    target = Path(root, f"dcp-{rep}")
                    writer = dcp.FileSystemWriter(target)
                    times[name].append(timed(lambda w=writer: dcp.save(state, storage_writer=w)))
                    if rank == 0:
                        shutil.rmtree(target, ignore_errors=True)
        if rank == 0:
            newest = max(Path(root, "vault").glob("step-*"))
            manifest_bytes = (newest / "manifest.json").stat().st_size
    if rank == 0:
        Path(out).write_text(
            json.dumps({"times": times, "bytes": total, "manifest": manifest_bytes})
        )
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def run(size_gb: float, ranks: int, reps: int, base: str | None) -> dict[str, object]:
    root = tempfile.mkdtemp(prefix="ckptvault-bench-", dir=base)
    out = os.path.join(root, "result.json")
    port = _free_port()
    try:
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "bench.multirank_save",
                    "--worker",
                    root,
                    out,
                    "--size-gb",
                    str(size_gb),
                    "--reps",
                    str(reps),
                ],
                env=dict(
                    os.environ,
                    RANK=str(rank),
                    WORLD_SIZE=str(ranks),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                ),
            )
            for rank in range(ranks)
        ]
        if any(proc.wait() != 0 for proc in procs):
            raise SystemExit("a rank of the benchmark failed")
        result: dict[str, object] = json.loads(Path(out).read_text())
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


def table(result: dict[str, object], ranks: int, where: str) -> str:
    times: dict[str, list[float]] = result["times"]  # type: ignore[assignment]
    total = int(result["bytes"])  # type: ignore[call-overload]
    base_median = statistics.median(times["DCP FileSystemWriter"])
    base_best = min(times["DCP FileSystemWriter"])
    lines = [
        f"{total / 1e9:.2f} GB sharded over {ranks} ranks, {where}, "
        f"{len(times['ckptvault'])} interleaved reps; manifest {result['manifest']} bytes",
        "",
        "| contender | median s | GB/s (median) | x DCP (median) | best s | x DCP (best) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, values in times.items():
        median, best = statistics.median(values), min(values)
        lines.append(
            f"| {name} | {median:.3f} | {total / median / 1e9:.2f} | "
            f"{base_median / median:.2f} | {best:.3f} | {base_best / best:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=0.5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to save (default: the temp dir)")
    parser.add_argument("--worker", nargs=2, metavar=("ROOT", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.size_gb, args.reps, *args.worker)
        return
    where = args.dir or tempfile.gettempdir()
    result = run(args.size_gb, args.ranks, args.reps, args.dir)
    print(table(result, args.ranks, where))


if __name__ == "__main__":
    main()
