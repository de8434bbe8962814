"""Peak memory of a one-process restore: ckptvault, in place and not, and torch.load.

    python -m bench.restore_rss --size-gb 1 [--reps 3] [--dir bench-out/restore-rss]

Saves a model + AdamW state of about ``--size-gb`` GB (bench.contenders.build) with
ckptvault and with torch.save, then restores it, each contender in a fresh process
of its own, interleaved over ``--reps`` with the order rotated:

- ckptvault ``restore()`` (every byte verified into private buffers, then copied);
- ckptvault ``restore(..., in_place=True)`` (verified in a first pass, then read into
  the live tensors: :mod:`ckptvault.io.in_place`);
- torch.load(weights_only=True) + load_state_dict, and the same with ``mmap=True``.

Each process builds live objects that hold a state already (a model and an optimizer
that has stepped, as a job restoring in place holds them), imports and warms up what
a restore needs, resets its peak resident set (``/proc/self/clear_refs``) and
restores: the figure is the peak (``VmHWM``) above the resident set just before, so
the interpreter and the live state are not counted. Goal: in place, <= 64 MiB. The
store is page-cached (just written); seconds are the restore call's. Prints a
Markdown table: medians and best runs.
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

from bench.measure import quiesce, rotated

GOAL_MIB = 64
WIDTH = 2048  # layers of 2048 x 2048: the state comes within 5% of --size-gb
CONTENDERS = {
    "ckptvault restore()": "private",
    "ckptvault restore(in_place=True)": "in_place",
    "torch.load + load_state_dict": "torch",
    "torch.load(mmap=True) + load_state_dict": "torch_mmap",
}


def _status_kib(name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise LookupError(name)


def _worker(kind: str, work: Path, size_gb: float) -> None:
    import gc

    import torch

    import ckptvault as cv
    from bench.contenders import build, state_bytes, torch_save

    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    if kind == "save":
        model, opt = build(size_gb, seed=0, width=WIDTH)
        with cv.CheckpointManager(work / "store", run_id="bench", catalog=False) as mgr:
            mgr.save(1, {"model": model, "optimizer": opt})
        torch_save(work / "state.pt", model, opt)
        print(json.dumps({"state": state_bytes(model, opt)}))
        return
    model, opt = build(size_gb, seed=1, width=WIDTH)  # live objects holding a state already
    state = {"model": model, "optimizer": opt}
    warm = work / f"warm-{os.getpid()}"
    with cv.CheckpointManager(warm, run_id="warm", catalog=False) as mgr:  # imports, once
        mgr.save(1, {"x": torch.ones(1000)})
        mgr.restore({"x": torch.zeros(1000)}, in_place=kind == "in_place")
    torch.save({"x": torch.ones(10)}, warm / "x.pt")
    torch.load(warm / "x.pt", weights_only=True)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    started = time.perf_counter()
    if kind in ("private", "in_place"):
        with cv.CheckpointManager(work / "store", run_id="bench", catalog=False) as mgr:
            info = mgr.restore(state, in_place=kind == "in_place")
        assert info is not None
    else:
        loaded = torch.load(work / "state.pt", weights_only=True, mmap=kind == "torch_mmap")
        model.load_state_dict(loaded["model"])
        opt.load_state_dict(loaded["optimizer"])
        del loaded
    seconds = time.perf_counter() - started
    extra = (_status_kib("VmHWM") - before) * 1024
    print(json.dumps({"seconds": seconds, "extra": extra, "state": state_bytes(model, opt)}))


def _run(kind: str, work: Path, size_gb: float) -> dict[str, float]:
    argv = [sys.executable, "-m", "bench.restore_rss", "--worker", kind]
    argv += ["--dir", str(work), "--size-gb", str(size_gb)]
    done = subprocess.run(argv, check=True, stdout=subprocess.PIPE, text=True, timeout=1800)
    result: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("bench-out/restore-rss"))
    parser.add_argument("--worker")
    args = parser.parse_args()
    work = args.dir.resolve()
    if args.worker:
        _worker(args.worker, work, args.size_gb)
        return
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        state = int(_run("save", work, args.size_gb)["state"])
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in CONTENDERS}
        for _ in range(args.reps):
            for name in rotated(list(CONTENDERS)):
                quiesce()
                runs[name].append(_run(CONTENDERS[name], work, args.size_gb))
        mib = 2**20
        print(
            f"\nOne process, {state / 1e9:.2f} GB of state (model + AdamW), page-cached, "
            f"{args.reps} reps; peak resident memory above the live state\n"
        )
        print(
            "| restore | peak RSS above live state, MiB, median (best) | goal | "
            "seconds, median (best) |"
        )
        print("|---|---|---|---|")
        for name, results in runs.items():
            extra = [r["extra"] / mib for r in results]
            seconds = [r["seconds"] for r in results]
            goal = ""
            if CONTENDERS[name] == "in_place":
                met = statistics.median(extra) <= GOAL_MIB
                goal = f"<= {GOAL_MIB} MiB: {'met' if met else 'not met'}"
            print(
                f"| {name} | {statistics.median(extra):.0f} ({min(extra):.0f}) | {goal} | "
                f"{statistics.median(seconds):.2f} ({min(seconds):.2f}) |"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
