"""Peak resident memory a save (or a restore) adds, measured in a fresh process.

    python -m bench.scale_memory --count 100000 --dir DIR --contender ckptvault

Builds ``count`` tensors of 256 float32 (a flat dict), saves them once (ckptvault:
twice, so the measured save is a later save of the layout, not the one that builds
caches), resets the kernel's high-water mark of the process (``/proc/self/clear_refs``;
where that is refused, a sampling thread watches instead), saves (or restores into
preallocated tensors) once more, and prints one JSON line: the data's bytes and the
peak growth of resident memory above the state already held. A growth near the
data's size or below is bounded by the data; one of many times it, or of hundreds
of bytes per tensor, is Python objects per tensor.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

import ckptvault as cv
from bench.measure import PeakRSS, rss_bytes
from bench.scale_tensors import Pair, make_pair, torch_restore, torch_save

CONTENDERS = ("ckptvault", "torch")
REPO = Path(__file__).resolve().parents[1]


def _kib(field: str) -> int:
    with open("/proc/self/status") as handle:
        match = re.search(rf"^{field}:\s+(\d+) kB", handle.read(), re.MULTILINE)
    return int(match.group(1)) * 1024 if match else 0


def peak_growth(fn: Callable[[], object]) -> int:
    """Peak resident bytes above the current ones while ``fn`` runs."""
    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5\n")  # resets VmHWM to the current resident size
    except OSError:
        with PeakRSS(interval=0.001) as peak:
            fn()
        return peak.extra
    before = rss_bytes()
    fn()
    return max(0, _kib("VmHWM") - before)


def _actions(contender: str, pair: Pair, root: Path) -> tuple[Callable[[], object], ...]:
    """(warm-up, measured save, measured restore) of ``contender``."""
    if contender == "torch":
        path = root / "torch.pt"
        return (
            lambda: torch_save(pair, path),
            lambda: torch_save(pair, path),
            lambda: torch_restore(pair, path),
        )
    manager = cv.CheckpointManager(root / "vault", run_id="scale-memory")
    steps = iter(range(1, 1 << 30))

    def restore() -> None:
        with cv.CheckpointManager(root / "vault", run_id="scale-memory") as reader:
            reader.restore(pair.target)

    return (
        lambda: manager.save(next(steps), pair.source),
        lambda: manager.save(next(steps), pair.source),
        restore,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--contender", choices=CONTENDERS, default="ckptvault")
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    pair = make_pair("flat", args.count)
    warm, save, restore = _actions(args.contender, pair, args.dir)
    warm()
    result = {
        "contender": args.contender,
        "count": args.count,
        "data_bytes": sum(t.numel() * t.element_size() for t in pair.source.values()),
        "save_growth": peak_growth(save),
        "restore_growth": peak_growth(restore),
    }
    print(json.dumps(result))


def measure_memory(count: int, root: Path, contender: str) -> dict[str, int]:
    """Run :func:`main` in a fresh process (nothing else's memory in the figures)."""
    where = root / f"memory-{contender}"
    command = [sys.executable, "-m", "bench.scale_memory", "--count", str(count)]
    command += ["--dir", str(where.resolve()), "--contender", contender]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    finally:
        shutil.rmtree(where, ignore_errors=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
    result: dict[str, int] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


if __name__ == "__main__":
    main()
