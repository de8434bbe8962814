"""Recovery from the memory tier against recovery from the store, in one run.

    python -m bench.memory_tier --size-gb 1 [--reps 3] [--dir bench-out/memory]

Saves a model + AdamW state of about ``--size-gb`` GB once into a memory tier (on
``/dev/shm``) with its durable copy in a POSIX store, then, interleaved over
``--reps`` repetitions with the order rotated, measures:

- recovery: a new process that builds fresh objects, opens a ``CheckpointManager``
  and restores, timed from the process's start to the state applied and for the
  ``restore()`` call alone, from memory (``source == "memory"``) and from the store
  with its pages dropped first (``/proc/sys/vm/drop_caches`` as root, ``fadvise``
  otherwise) and with them cached;
- the save stall of a blocking save into memory only against a durable save into
  the store.

Prints a Markdown table (medians and best runs, the ratio memory / store) and
whether the goal is met: recovery from memory at most 0.25x the time from the store.
One process on one node: copies across nodes (a peer's memory) are not built yet.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ckptvault as cv
from bench.contenders import build, state_bytes
from bench.measure import drop_caches, quiesce, rotated

GOAL = 0.25
RESTORE = """
import json, sys, time
started = float(sys.argv[1])
import torch
torch.set_num_threads(1)
import ckptvault as cv
from bench.contenders import fresh_like
model, optimizer = fresh_like({size_gb})
options = json.loads(sys.argv[2])
memory = options.pop("memory", None)
tier = cv.MemoryTier(path=memory, keep=1, durable_every=1) if memory else None
with cv.CheckpointManager(options["store"], run_id="bench", memory_tier=tier) as mgr:
    began = time.time()
    info = mgr.restore({{"model": model, "optim": optimizer}})
    done = time.time()
print(json.dumps({{"total": done - started, "restore": done - began, "source": info.source}}))
"""


def _restore(size_gb: float, store: Path, memory: Path | None) -> dict[str, float | str]:
    options = {"store": str(store), **({"memory": str(memory)} if memory else {})}
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            RESTORE.format(size_gb=size_gb),
            repr(time.time()),
            json.dumps(options),
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[1],
    )
    return json.loads(result.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("bench-out/memory"))
    args = parser.parse_args()
    work = args.dir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    memory = Path(f"/dev/shm/ckptvault-bench-{os.getpid()}")
    try:
        results = _run(args.size_gb, args.reps, work, memory)
    finally:
        shutil.rmtree(memory, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
    _report(results, args.size_gb)


def _run(size_gb: float, reps: int, work: Path, memory: Path) -> dict[str, list[float]]:
    model, optimizer = build(size_gb)
    state = {"model": model, "optim": optimizer}
    print(f"state: {state_bytes(model, optimizer) / 1e9:.2f} GB", file=sys.stderr)
    results: dict[str, list[float]] = {}
    tier = cv.MemoryTier(path=memory, keep=1, durable_every=1)
    with cv.CheckpointManager(work / "store", run_id="bench", memory_tier=tier) as mgr:
        mgr.save(1, state, blocking=True)  # in memory and, verified, in the store
    stall_tier = cv.MemoryTier(path=memory / "stall", keep=1, durable_every=10**9)
    with (
        cv.CheckpointManager(
            work / "stall-memory", run_id="s", memory_tier=stall_tier
        ) as in_memory,
        cv.CheckpointManager(work / "stall-store", run_id="s") as durable,
    ):
        for rep in range(reps):
            for name, manager in rotated(
                [("save stall: memory", in_memory), ("save stall: store", durable)]
            ):
                quiesce()
                began = time.perf_counter()
                manager.save(rep + 2, state, blocking=True)
                results.setdefault(name, []).append(time.perf_counter() - began)
    del model, optimizer, state
    cases = [("memory", memory), ("store, cold", None), ("store, cached", None)]
    for _ in range(reps):
        for name, where in rotated(cases):
            if name == "store, cold":
                drop_caches(work / "store")
            else:
                quiesce()
            measured = _restore(size_gb, work / "store", where)
            expected = "memory" if where else "store"
            assert measured["source"] == expected, (name, measured)
            for part in ("total", "restore"):
                results.setdefault(f"{part}: {name}", []).append(float(measured[part]))
    return results


def _report(results: dict[str, list[float]], size_gb: float) -> None:
    def median(name: str) -> float:
        return statistics.median(results[name])

    def best(name: str) -> float:
        return min(results[name])

    print(f"| {size_gb:g} GB, one process | median s | best s | memory / store (median, best) |")
    print("|---|---|---|---|")
    for part, label in (("total", "restart to state applied"), ("restore", "restore() alone")):
        for case in ("memory", "store, cold", "store, cached"):
            name = f"{part}: {case}"
            ratio = ""
            if case != "memory":
                memory = f"{part}: memory"
                ratio = f"{median(memory) / median(name):.2f}x, {best(memory) / best(name):.2f}x"
            print(f"| {label}, {case} | {median(name):.3f} | {best(name):.3f} | {ratio} |")
    for case in ("memory", "store"):
        name = f"save stall: {case}"
        print(f"| blocking save, {case} | {median(name):.3f} | {best(name):.3f} | |")
    met = best("restore: memory") <= GOAL * best("restore: store, cold")
    print(
        f"\ngoal (restore from memory <= {GOAL}x the store, cold, best runs): {'met' if met else 'NOT met'}"
    )


if __name__ == "__main__":
    main()
