"""Scaling benchmark: how save, restore, metadata and listing costs grow.

    python -m bench.scale [--counts 1000 10000 100000] [--reps 5 3 1]
                          [--ranks 1 8 64 256 1024] [--generations 10 100 1000]

Three axes (issue 15, item 4), each against the peers on the same sizes:

- **tensor count** (:mod:`bench.scale_tensors`): N tensors of 256 float32, flat and
  as a module's state; torch.save, safetensors, DCP and ckptvault save (+fsync) and
  restore into existing tensors, interleaved over repetitions with the contenders'
  order rotated; on the disk (``--dir``) and on tmpfs (``/dev/shm``, where no disk
  hides the software). Also the peak resident memory a save of the largest count
  adds (:mod:`bench.scale_memory`, in a fresh process);
- **simulated ranks** (:mod:`bench.scale_ranks`): DCP's global plan and ckptvault's
  manifest for a 723-parameter model sharded over N ranks, built in one process;
- **generations** (:mod:`bench.scale_generations`): ``ls``, ``generations()``, restore
  discovery on stores of N generations.

Prints one Markdown table per axis with the growth of each cost (the slope on
log-log axes) and the issue's targets, and writes them to ``--out``/scale.md, the
figures to scale.json and the plot to scale.png (when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from bench import scale_report as report
from bench.scale_generations import measure_generations
from bench.scale_memory import measure_memory
from bench.scale_ranks import RankPoint, gpt_model, measure_ranks
from bench.scale_tensors import LAYOUTS, Point, measure_count


def _tmpfs(requested: Path | None, enabled: bool) -> Path | None:
    if not enabled:
        return None
    if requested is None:
        shm = Path("/dev/shm")
        if not (shm.is_dir() and os.access(shm, os.W_OK)):
            return None
        requested = shm / f"ckptvault-scale-{os.getpid()}"
    requested.mkdir(parents=True, exist_ok=True)
    return requested


def rounds(args: argparse.Namespace, index: int) -> int:
    """Rounds at the ``index``-th count: ``--reps`` in order, its last one repeating."""
    return int(args.reps[min(index, len(args.reps) - 1)])


def run_tensors(args: argparse.Namespace, tmpfs: Path | None) -> list[Point]:
    roots = {"disk": args.dir / "tensors"}
    if tmpfs is not None:
        roots["tmpfs"] = tmpfs
    for root in roots.values():
        root.mkdir(parents=True, exist_ok=True)
    points = []
    for index, count in enumerate(args.counts):
        reps = rounds(args, index)
        layouts = LAYOUTS if count <= args.module_up_to else ("flat",)
        started = time.perf_counter()
        points.append(measure_count(count, roots, layouts, reps))
        print(f"{count:,} tensors: {reps} rounds in {time.perf_counter() - started:.0f} s",
              flush=True)  # fmt: skip
    return points


def run_ranks(args: argparse.Namespace) -> list[RankPoint]:
    model = gpt_model(layers=args.layers, width=args.width)
    points = []
    for ranks in args.ranks:
        started = time.perf_counter()
        points.append(measure_ranks(ranks, model))
        print(f"{ranks:,} ranks: {time.perf_counter() - started:.0f} s", flush=True)
    return points


def run_generations(args: argparse.Namespace) -> dict[int, dict[str, float]]:
    results = {}
    for count in args.generations:
        started = time.perf_counter()
        results[count] = measure_generations(count, args.dir / "listing")
        print(f"{count:,} generations: {time.perf_counter() - started:.0f} s", flush=True)
    return results


def render(results: dict[str, Any], points: list[Point], args: argparse.Namespace) -> str:
    """The Markdown the benchmark prints and writes."""
    lines = [f"Scaling benchmark; {results['machine']}.", ""]
    if points:
        reps = ", ".join(f"{n:,}: {rounds(args, i)}" for i, n in enumerate(args.counts))
        lines += ["## Tensor count", "", f"Seconds: best (median) of the interleaved rounds "
                  f"({reps} rounds); a lone figure is a single round.", ""]  # fmt: skip
        for fs, where in results["filesystems"].items():
            lines += [*report.tensor_table(points, fs, f"On {fs} ({where}):"), ""]
        lines += ["Targets at 10,000 tensors, judged on best runs:", "",
                  *report.verdicts(points), ""]  # fmt: skip
    if results.get("memory"):
        lines += ["Peak resident memory a save of the largest count adds (fresh process, a "
                  "later save of the layout):", "", *report.memory_table(results["memory"]), ""]  # fmt: skip
    if results.get("ranks"):
        rank_points = [RankPoint(**p) for p in results["ranks"]]
        first = rank_points[0]
        lines += ["## Simulated ranks", "", f"{first.parameters} parameters (GPT-like, float32, "
                  f"{first.data_bytes / 1e9:,.0f} GB), each sharded on dim 0 over every rank; "
                  "DCP plans built in one process.", "", *report.rank_table(rank_points), ""]  # fmt: skip
    if results.get("generations"):
        lines += ["## Generations", "", "Seconds, best of 3, POSIX store:", "",
                  *report.generation_table(results["generations"]), ""]  # fmt: skip
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--axes", nargs="+", default=["tensors", "ranks", "generations"],
                        choices=["tensors", "ranks", "generations"])  # fmt: skip
    parser.add_argument("--counts", type=int, nargs="+", default=[1000, 10_000, 100_000])
    parser.add_argument("--reps", type=int, nargs="+", default=[5, 3, 1],
                        help="rounds per count, in order (the last one repeats)")  # fmt: skip
    parser.add_argument("--module-up-to", type=int, default=10_000,
                        help="the module layout is measured up to this count")  # fmt: skip
    parser.add_argument("--no-tmpfs", action="store_true")
    parser.add_argument("--tmpfs-dir", type=Path, default=None)
    parser.add_argument("--memory-count", type=int, default=None,
                        help="tensors in the memory measurement (default: the largest count; 0: skip)")  # fmt: skip
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    parser.add_argument("--layers", type=int, default=60, help="60: 723 parameters")
    parser.add_argument("--width", type=int, default=18432, help="18432: ~980 GB at 60 layers")
    parser.add_argument("--generations", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--dir", type=Path, default=Path("bench-out/scale-work"))
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    args.dir.mkdir(parents=True, exist_ok=True)
    tmpfs = _tmpfs(args.tmpfs_dir, "tensors" in args.axes and not args.no_tmpfs)
    results: dict[str, Any] = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"Python {platform.python_version()}",
        "filesystems": {"disk": str(args.dir.resolve())},
    }
    if tmpfs is not None:
        results["filesystems"]["tmpfs"] = str(tmpfs)
    points: list[Point] = []
    try:
        if "tensors" in args.axes:
            points = run_tensors(args, tmpfs)
            results["tensors"] = [
                {"count": p.count, "seconds": {"|".join(k): v for k, v in p.seconds.items()}}
                for p in points
            ]
            memory_count = args.memory_count if args.memory_count is not None else max(args.counts)
            if memory_count:
                results["memory"] = [measure_memory(memory_count, args.dir, c)
                                     for c in ("ckptvault", "torch")]  # fmt: skip
        if "ranks" in args.axes:
            results["ranks"] = [dataclasses.asdict(p) for p in run_ranks(args)]
        if "generations" in args.axes:
            results["generations"] = run_generations(args)
    finally:
        if tmpfs is not None and args.tmpfs_dir is None:
            shutil.rmtree(tmpfs, ignore_errors=True)
    return write(results, points, args)


def write(results: dict[str, Any], points: list[Point], args: argparse.Namespace) -> str:
    text = render(results, points, args)
    args.out.mkdir(parents=True, exist_ok=True)
    note = report.plot(results, points, args.out / "scale.png")
    text += f"\n{note}\n"
    print("\n" + text)
    (args.out / "scale.md").write_text(text)
    (args.out / "scale.json").write_text(json.dumps(results, indent=1))
    return text


if __name__ == "__main__":
    main()
