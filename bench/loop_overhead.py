"""What checkpointing costs the training loop: ckptvault's asynchronous saves against
DCP's ``async_save`` in each of its modes, at two cadences, in one run.

    python -m bench.loop_overhead [--state-mb 100] [--cadences 2,30] [--saves 10,2]
                                  [--reps 3] [--dir bench-out/loop] [--quick]

The same training loop (an MLP + AdamW on CPU, about ``--state-mb`` MB of state;
:mod:`bench.loop_worker`) runs with no checkpoints and with each contender:

- ``ckptvault-thread``: ``CheckpointManager(..., async_save=True)``, ``prepare`` once;
- ``ckptvault-process``: the same with ``async_mode="process"``, when this ckptvault
  has it;
- ``dcp-thread`` / ``dcp-process``: ``dcp.async_save`` to a ``FileSystemWriter``
  with the thread and the process executor, DCP's defaults otherwise;
- ``dcp-thread-cached`` / ``dcp-process-cached``: the same with a kept
  ``DefaultStager`` whose (shared-memory, for the process) buffers every save reuses.

A calibration run first times the loop's step; each cadence (seconds between saves)
becomes a number of steps K. A run is ``2 x saves`` blocks of K steps, a block with a
save (which ends once that save is durable) and a plain block in turn, after one
warm-up save (:mod:`bench.loop_worker`). A contender's overhead at a cadence is the
extra wall time a save adds over the seconds between saves, measured two ways:

- paired blocks: in each run, the median over its saves of a save block's time over
  the plain block after it, minus one; the median of that over repetitions (the
  plain blocks are the no-checkpoint loop, seconds apart in the same process: a
  drift in the machine's load cancels; ``none``'s row shows what the pairing reads
  when nothing is saved);
- separate runs: the run's wall time against the ``none`` run's (all blocks plain)
  of the same repetition: ``2 x (wall / wall_none - 1)``, as half the blocks save;
  its median over repetitions, and the best run against the best ``none`` run. This
  one also counts whatever a save leaves behind for the next block.

Beside them, what does not depend on the machine's other load: after the loop, each
run takes three saves with no training beside them and measures the CPU seconds
each costs (the process, its threads and its helper processes, from ``/proc``) and
its time until durable. CPU per save over the seconds between saves is the overhead
a save would add if every cycle it spends were taken from training (no idle core);
on a machine with a core to spare it costs less (what remains is the stall and the
GIL).

Every run is a fresh process (its result comes back as a JSON file written before
it exits: torch 2.13's DCP ``async_save`` aborts about one exit in twenty, which is
ignored, and said, when the result was written). Over ``--reps`` repetitions the
contenders' order and the cadences' order are rotated.

Goals (issue 27): ckptvault's overhead at most DCP's best mode at each cadence, and at
most 1 % at the ~30 s cadence. Results go to ``bench-out/loop_overhead.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.features import process_mode_available
from bench.loop_worker import Spec
from bench.measure import rotated

BASELINE = "none"
DCP_CONTENDERS = ["dcp-thread", "dcp-thread-cached", "dcp-process", "dcp-process-cached"]
LOOSE_GOAL = 0.01  # at most 1 % at the slow cadence
RUN_TIMEOUT_S = 1800


def contenders(wanted: Sequence[str] | None) -> list[str]:
    """The baseline first, then every contender this checkout has (or ``wanted`` of them)."""
    names = ["ckptvault-thread"]
    if process_mode_available():
        names.append("ckptvault-process")
    names += DCP_CONTENDERS
    if wanted:
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            raise SystemExit(f"unknown or unavailable contenders: {', '.join(unknown)}")
        names = [n for n in names if n in wanted]
    return [BASELINE, *names]


class Runner:
    """Runs one spec in a fresh ``python -m bench.loop_worker`` process."""

    def __init__(self, root: Path, threads: int = 0) -> None:
        self.root, self.threads = root, threads
        self.state_home = Path(tempfile.mkdtemp(prefix="ckptvault-loop-state-"))
        self.exit_aborts: list[str] = []  # runs that aborted after writing their result

    def run(self, contender: str, state_mb: float, saves: int, every: int,
            calibrate_s: float = 0.0) -> dict[str, Any]:  # fmt: skip
        directory = self.root / f"run-{contender}"
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        result = self.root / f"{contender}.result.json"
        result.unlink(missing_ok=True)
        spec = Spec(contender, state_mb, saves, every, str(directory), str(result), calibrate_s,
                    self.threads)  # fmt: skip
        spec_path = self.root / f"{contender}.spec.json"
        spec_path.write_text(json.dumps(asdict(spec)))
        # The catalog and ledger of ckptvault's runs go to a directory of this bench's.
        env = dict(os.environ, XDG_STATE_HOME=str(self.state_home))
        try:
            done = subprocess.run(
                [sys.executable, "-m", "bench.loop_worker", str(spec_path)],
                env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"contender": contender, "error": f"no result within {RUN_TIMEOUT_S} s"}
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        if not result.exists():  # a failed run, not an abort at exit: reported, not counted
            tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
            return {"contender": contender,
                    "error": f"exited {done.returncode} without a result: {tail[0]}"}  # fmt: skip
        measured: dict[str, Any] = json.loads(result.read_text())
        if done.returncode != 0:
            self.exit_aborts.append(f"{contender} (exit {done.returncode})")
        return measured

    def close(self) -> None:
        shutil.rmtree(self.state_home, ignore_errors=True)


def calibrate(runner: Runner, state_mb: float, seconds: float) -> tuple[float, int]:
    """Seconds per step of the no-checkpoint loop and the state's bytes."""
    measured = runner.run(BASELINE, state_mb, 0, 0, calibrate_s=seconds)
    if "error" in measured:
        raise SystemExit(f"calibration failed: {measured['error']}")
    return float(measured["step_s"]), int(measured["bytes"])


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--state-mb", type=float, default=100.0)
    parser.add_argument("--cadences", default="2,30", help="seconds between saves, comma-separated")
    parser.add_argument("--saves", default="10,2", help="saves per run at each cadence")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--contenders", default="", help="comma-separated subset (default all)")
    parser.add_argument("--dir", type=Path, default=Path("bench-out/loop"))
    parser.add_argument("--out", type=Path, default=Path("bench-out/loop_overhead.json"))
    parser.add_argument("--steps-per-save", default="",
                        help="steps between saves at each cadence (default: from a calibration run)")  # fmt: skip
    parser.add_argument("--torch-threads", type=int, default=0,
                        help="the loop's intra-op threads (default: torch's, every core)")  # fmt: skip
    parser.add_argument("--quick", action="store_true",
                        help="a check that it runs: 20 MB, cadences 0.5 and 2 s, 2 saves, 1 rep")  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.state_mb, args.cadences, args.saves, args.reps = 20.0, "0.5,2", "2,2", 1
    cadences = [float(c) for c in args.cadences.split(",")]
    saves = [int(s) for s in args.saves.split(",")]
    if len(saves) != len(cadences) or min(saves) < 1 or min(cadences) <= 0:
        raise SystemExit("--saves needs one count >= 1 per cadence, and cadences > 0")
    names = contenders([c for c in args.contenders.split(",") if c])
    args.dir.mkdir(parents=True, exist_ok=True)
    runner = Runner(args.dir, args.torch_threads)
    try:
        if args.steps_per_save:
            steps = [int(k) for k in args.steps_per_save.split(",")]
            step_s, nbytes = float("nan"), 0
        else:
            step_s, nbytes = calibrate(runner, args.state_mb, 2.0 if args.quick else 5.0)
            steps = [max(1, round(c / step_s)) for c in cadences]
            print(f"state {nbytes / 1e6:.0f} MB; a step takes {step_s * 1e3:.1f} ms", flush=True)
        if len(steps) != len(cadences) or min(steps) < 1:
            raise SystemExit("--steps-per-save needs one count >= 1 per cadence")
        plans = list(zip(cadences, steps, saves, strict=True))
        print(f"contenders: {', '.join(names)}", flush=True)
        results: dict[float, dict[str, list[dict[str, Any]]]] = {c: {} for c in cadences}
        for rep in range(args.reps):
            for cadence, every, count in rotated(plans):
                for name in rotated(names):
                    print(f"rep {rep + 1}/{args.reps}, cadence {cadence:g} s: {name}", flush=True)
                    measured = runner.run(name, args.state_mb, count, every)
                    results[cadence].setdefault(name, []).append(measured)
    finally:
        runner.close()
    if not nbytes:  # no calibration run: the sizes and step time the runs measured
        nbytes = next((r["bytes"] for runs in results.values() for m in runs.values() for r in m
                       if "bytes" in r), 0)  # fmt: skip
        none = results[cadences[0]][BASELINE]
        blocks = [b for r in none if "error" not in r for b in r["plain_blocks_s"]]
        step_s = statistics.median(blocks) / steps[0] if blocks else float("nan")
    report(results, plans, step_s, nbytes, runner.exit_aborts, args)


# -- the report ---------------------------------------------------------------------------


MEASURES = [
    ("paired_median", "paired blocks, median of runs"),
    ("separate_median", "separate runs, median of paired"),
    ("separate_best", "separate runs, best vs best"),
    ("cpu_bound", "CPU per save / cadence"),
]


def paired_overhead(run: dict[str, Any]) -> float:
    """One run's overhead by its paired blocks: the median over its saves of the save
    block's time over the plain block after it, minus one (a median: a burst of
    another process's load hits one pair, not the figure)."""
    pairs = zip(run["save_blocks_s"], run["plain_blocks_s"], strict=True)
    return statistics.median(saving / plain for saving, plain in pairs) - 1


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per contender: wall times, the overhead by each of MEASURES, stalls."""
    base = {i: r["wall_s"] for i, r in enumerate(runs.get(BASELINE, [])) if "error" not in r}
    plain = [b for r in runs.get(BASELINE, []) if "error" not in r for b in r["plain_blocks_s"]]
    block = statistics.median(plain) if plain else float("nan")  # the cadence, measured
    summary: dict[str, dict[str, float]] = {}
    for name, measured in runs.items():
        ok = [(i, r) for i, r in enumerate(measured) if "error" not in r]
        if not ok or not base:
            continue
        walls = [r["wall_s"] for _, r in ok]
        paired = [paired_overhead(r) for _, r in ok]
        separate = [2 * (r["wall_s"] / base[i] - 1) for i, r in ok if i in base]
        saves = max(1, ok[0][1]["saves"])
        summary[name] = {
            "saves": ok[0][1]["saves"],
            "median_s": statistics.median(walls),
            "best_s": min(walls),
            "paired_median": statistics.median(paired),
            "separate_median": statistics.median(separate) if separate else float("nan"),
            "separate_best": 2 * (min(walls) / min(base.values()) - 1),
            "stall_per_save_s": statistics.median(r["stall_s"] / saves for _, r in ok),
            "stall_max_s": max(r["stall_max_s"] for _, r in ok),
            "drain_per_save_s": statistics.median(r["drain_s"] / saves for _, r in ok),
            "setup_s": statistics.median(r.get("setup_s", 0.0) for _, r in ok),
            "plain_block_s": statistics.median(b for _, r in ok for b in r["plain_blocks_s"]),
            "cpu_per_save_s": statistics.median(r.get("isolated_cpu_s", 0.0) for _, r in ok),
            "cpu_bound": statistics.median(r.get("isolated_cpu_s", 0.0) for _, r in ok) / block,
            "durable_s": statistics.median(r.get("isolated_wall_s", 0.0) for _, r in ok),
        }
    return summary


def table(summary: dict[str, dict[str, float]], cadence: float, every: int) -> list[str]:
    block = summary[BASELINE]["plain_block_s"] if BASELINE in summary else float("nan")
    lines = [
        f"Cadence {cadence:g} s: a save every {every} steps (measured: {block:.2f} s of the "
        "no-checkpoint loop, median).",
        "",
        "| contender | saves a run | wall s (median) | wall s (best) "
        + "".join(f"| overhead: {what} " for _, what in MEASURES)
        + "| stall per save s | wait at block end s | first save s | CPU s per save "
        "| alone: save to durable s |",
        "|---|---:|---:|---:|" + "---:|" * len(MEASURES) + "---:|---:|---:|---:|---:|",
    ]
    for name, s in summary.items():
        lines.append(
            f"| {name} | {s['saves']:.0f} | {s['median_s']:.2f} | {s['best_s']:.2f} "
            + "".join(f"| {s[key]:+.2%} " for key, _ in MEASURES)
            + f"| {s['stall_per_save_s']:.3f} | {s['drain_per_save_s']:.3f} | {s['setup_s']:.2f} "
            f"| {s['cpu_per_save_s']:.3f} | {s['durable_s']:.3f} |"
        )
    return lines


def verdicts(summaries: dict[float, dict[str, dict[str, float]]], slow: float) -> list[str]:
    """Each ckptvault mode against DCP's best mode at every cadence, and against 1 %
    at the slow cadence, by each of MEASURES."""
    lines = []
    for cadence, summary in summaries.items():
        dcp = {n: s for n, s in summary.items() if n.startswith("dcp-")}
        for mine in (n for n in summary if n.startswith("ckptvault-") and dcp):
            for key, how in MEASURES:
                best_dcp = min(dcp, key=lambda n: dcp[n][key])
                ours, theirs = summary[mine][key], dcp[best_dcp][key]
                lines.append(f"- {cadence:g} s cadence, {mine} <= DCP's best mode ({best_dcp}), "
                             f"{how}: {ours:+.2%} vs {theirs:+.2%}: "
                             f"{'met' if ours <= theirs else 'NOT met'}")  # fmt: skip
    for mine in (n for n in summaries.get(slow, {}) if n.startswith("ckptvault-")):
        for key, how in MEASURES:
            ours = summaries[slow][mine][key]
            lines.append(f"- {slow:g} s cadence, {mine} <= 1 %, {how}: {ours:+.2%}: "
                         f"{'met' if ours <= LOOSE_GOAL else 'NOT met'}")  # fmt: skip
    return lines


def report(
    results: dict[float, dict[str, list[dict[str, Any]]]],
    plans: list[tuple[float, int, int]],
    step_s: float,
    nbytes: int,
    exit_aborts: list[str],
    args: argparse.Namespace,
) -> None:
    import torch

    machine = (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
               f"Python {platform.python_version()}")  # fmt: skip
    summaries = {cadence: summarize(runs) for cadence, runs in results.items()}
    threads = next((r["threads"] for runs in results.values() for m in runs.values() for r in m
                    if "threads" in r), "?")  # fmt: skip
    lines = [
        f"State: {nbytes / 1e6:.0f} MB (MLP + AdamW, CPU), step {step_s * 1e3:.1f} ms on "
        f"{threads} torch thread(s), {args.reps} interleaved runs per contender; {machine}.",
        "",
    ]
    for cadence, every, _ in plans:
        base = [r["wall_s"] for r in results[cadence][BASELINE] if "error" not in r]
        lines += table(summaries[cadence], cadence, every)
        spread = max(base) / min(base) - 1 if base else 0.0
        lines += ["", f"The no-checkpoint runs' wall times spread by {spread:.2%} "
                  "(the noise under the separate-runs figures).", ""]  # fmt: skip
    for cadence, runs in results.items():
        for name, measured in runs.items():
            for r in measured:
                if "error" in r:
                    lines.append(f"- {cadence:g} s, {name}: FAILED: {r['error']}")
    if exit_aborts:
        lines.append(f"- Runs that aborted at interpreter exit after writing their result "
                     f"(counted; torch's teardown): {', '.join(exit_aborts)}")  # fmt: skip
    slow = max(c for c, _, _ in plans)
    lines += ["Goals:", "", *verdicts(summaries, slow)]
    text = "\n".join(lines)
    print()
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "bytes": nbytes, "step_s": step_s, "machine": machine, "reps": args.reps,
        "plans": plans, "results": {str(c): r for c, r in results.items()},
        "summary": {str(c): s for c, s in summaries.items()}, "table": text,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
