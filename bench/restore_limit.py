"""Restore against the physical limit: a cold verified restore against a plain read of
the same files, and a warm one against torch.load + load_state_dict, in one run.

    python -m bench.restore_limit --size-gb 1 [--reps 5] [--dir bench-out/restore]
                                  [--profile] [--quick]

Saves one generation of a model + AdamW state of about ``--size-gb`` GB (and the same
state with ``torch.save``), then, interleaved over ``--reps`` repetitions with the
order of the phases and of the contenders rotated, measures:

- cold, from the disk (the page cache dropped before each: ``/proc/sys/vm/drop_caches``
  as root, ``posix_fadvise(DONTNEED)`` on every file otherwise; the report says which):
  a plain sequential read of the generation's files (one thread, 8 MiB ``readinto``
  into one reused buffer: the disk's sequential read), the same read on as many
  threads as ckptvault reads with, the same read into freshly allocated memory (what
  any loader into new tensors pays at least: the kernel zeroes every new page),
  ckptvault's verified restore into freshly built objects (and with ``in_place=True``
  where this ckptvault's ``restore`` has it), and torch.load + load_state_dict of the
  torch.save'd file;
- warm (every file read once just before, so all of it is in the page cache): the
  same contenders;
- on tmpfs (``/dev/shm``; no disk at all): the same, where only software is timed.

Goals (issue 27): cold verified restore >= 0.9 x the plain read (``read s / restore
s``), and warm restore >= 1.2 x torch.load + load_state_dict (``torch s / ckptvault
s``: ckptvault's throughput over torch's). Judged on best runs, medians beside them.
``--profile`` adds a cProfile of one cold and one warm restore (where the time goes).
Every restore is checked bit for bit against the saved state (outside the clock).
Results go to ``bench-out/restore_limit.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import platform
import pstats
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

import ckptvault as cv
from bench.contenders import build, fresh_like, state_bytes, tensors_of, torch_restore, torch_save
from bench.features import in_place_available
from bench.measure import drop_caches, files_under, rotated, sync_all, timed
from bench.save_restore import tmpfs_root
from ckptvault.io.writer import default_threads

Measurement = tuple[float, int]  # seconds, peak extra resident bytes
READ_BLOCK = 8 << 20
PLAIN = "plain read"
PARALLEL = "plain read, parallel"
FRESH = "plain read into fresh memory"
VAULT = "ckptvault restore (verified)"
IN_PLACE = "ckptvault restore (verified, in_place=True)"
TORCH = "torch.load(weights_only)+load_state_dict"
COLD, WARM, TMPFS = "cold", "warm", "tmpfs"
COLD_GOAL, WARM_GOAL = 0.9, 1.2


# -- the contenders ---------------------------------------------------------------------


def plain_read(files: list[Path]) -> None:
    """Every byte of ``files``, front to back, one after another, into one buffer."""
    buffer = bytearray(READ_BLOCK)
    view = memoryview(buffer)
    for file in files:
        with open(file, "rb", buffering=0) as handle:
            while handle.readinto(view):
                pass


def fresh_read(files: list[Path]) -> list[torch.Tensor]:
    """Every byte of ``files`` into new memory, one buffer per file: what any loader
    that puts the bytes in fresh tensors pays at least (the kernel zeroes each new
    page as it is first written)."""
    kept = []
    for file in files:
        buffer = torch.empty(file.stat().st_size, dtype=torch.uint8)
        view = buffer.numpy().data
        with open(file, "rb", buffering=0) as handle:
            done = 0
            while done < len(view):
                got = handle.readinto(view[done : done + READ_BLOCK])
                if not got:
                    break
                done += got
        kept.append(buffer)
    return kept


def parallel_read(files: list[Path], threads: int) -> None:
    """The same, one file per thread at a time, ``threads`` at once."""
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda f: plain_read([f]), sorted(files, key=lambda f: -f.stat().st_size)))


def vault_restore(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                  in_place: bool = False) -> None:  # fmt: skip
    extra: dict[str, Any] = {"in_place": True} if in_place else {}
    with cv.CheckpointManager(path, run_id="bench") as mgr:
        info = mgr.restore({"model": model, "optimizer": opt}, **extra)
    assert info is not None, f"no generation found in {path}"


def width_for(size_gb: float) -> int:
    """The layers' width: 4096 as ``make bench`` measures; small states (the smoke
    test's) in narrower layers, so that they are small."""
    return 4096 if size_gb >= 0.5 else 1024


def evict(path: Path, how: str) -> str:
    """Evict ``path``'s pages from the page cache; returns how: ``drop_caches`` (the
    whole cache, as root) or ``fadvise`` (``POSIX_FADV_DONTNEED`` on every file)."""
    if how == "auto":
        return drop_caches(path)
    sync_all()
    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


class Bench:
    """One generation and one torch.save file of the same state under ``root``."""

    def __init__(self, root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer,
                 size_gb: float, evict: str = "auto") -> None:  # fmt: skip
        self.root, self.size_gb, self.evict = root, size_gb, evict
        self.width = width_for(size_gb)
        self.expected = {k: v.clone() for k, v in tensors_of(model, opt).items()}
        self.vault = root / "vault"
        self.torch_file = root / "state.pt"
        shutil.rmtree(self.vault, ignore_errors=True)
        with cv.CheckpointManager(self.vault, run_id="bench") as mgr:
            mgr.save(1, {"model": model, "optimizer": opt})
            generation = Path(mgr.generations()[-1].path)
        torch_save(self.torch_file, model, opt)
        if not generation.is_absolute():
            generation = self.vault / generation
        self.files = sorted(files_under(generation))  # the generation's, not the store's lock
        self.file_bytes = sum(f.stat().st_size for f in self.files)
        self.methods: set[str] = set()

    def close(self) -> None:
        shutil.rmtree(self.vault, ignore_errors=True)
        self.torch_file.unlink(missing_ok=True)

    def check(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        restored = tensors_of(model, opt)
        for name, value in self.expected.items():
            if not torch.equal(restored[name], value):
                raise AssertionError(f"restored {name} differs from what was saved")

    def make_ready(self, how: str, paths: list[Path]) -> None:
        """Cold: evict the pages; warm and tmpfs: have every page cached."""
        if how == COLD:
            for path in paths:
                self.methods.add(evict(path, self.evict))
        else:
            plain_read([f for p in paths for f in files_under(p)])

    def reads(self, how: str) -> list[tuple[str, Callable[[], Measurement]]]:
        def measure(read: Callable[[], object]) -> Callable[[], Measurement]:
            def run() -> Measurement:
                self.make_ready(how, [self.vault])
                return timed(read)

            return run

        return [
            (PLAIN, measure(lambda: plain_read(self.files))),
            (PARALLEL, measure(lambda: parallel_read(self.files, default_threads()))),
            (FRESH, measure(lambda: fresh_read(self.files))),
        ]

    def restores(self, how: str) -> list[tuple[str, Callable[[], Measurement]]]:
        def measure(path: Path, restore: Callable[..., None]) -> Callable[[], Measurement]:
            def run() -> Measurement:
                model, opt = fresh_like(self.size_gb, self.width)
                self.make_ready(how, [path])
                result = timed(lambda: restore(path, model, opt))
                self.check(model, opt)
                return result

            return run

        contenders = [
            (VAULT, measure(self.vault, vault_restore)),
            (TORCH, measure(self.torch_file, torch_restore)),
        ]
        if in_place_available():
            contenders.append(
                (IN_PLACE, measure(self.vault, lambda p, m, o: vault_restore(p, m, o, True)))
            )
        return contenders

    def phase(self, how: str) -> Iterator[tuple[str, Measurement]]:
        for name, run in rotated(self.reads(how) + self.restores(how)):
            yield f"{how}: {name}", run()

    def profile(self, how: str, top: int) -> str:
        """Where one ckptvault restore's time goes: its own stage clock (discovery,
        verification, read, apply), then cProfile of every thread it runs (the main
        thread and each reader thread profiled alike), the ``top`` functions by own
        time and by cumulative time."""
        model, opt = fresh_like(self.size_gb, self.width)
        self.make_ready(how, [self.vault])
        stages: dict[str, float] = {}
        with (
            thread_profiles() as profilers,
            cv.CheckpointManager(self.vault, run_id="bench") as mgr,
        ):
            mgr.events.subscribe(lambda event: stages.update(getattr(event, "stages", {})))
            started = time.perf_counter()
            mgr.restore({"model": model, "optimizer": opt})
            seconds = time.perf_counter() - started
        out = io.StringIO()
        clock = ", ".join(f"{name} {value:.3f} s" for name, value in stages.items())
        out.write(f"restore() {seconds:.3f} s under the profiler; its stages: {clock}\n")
        for profiler in profilers:
            profiler.create_stats()
        # A thread that started but never ran a profiled call has no stats to merge.
        stats = pstats.Stats(*(p for p in profilers if getattr(p, "stats", None)), stream=out)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
        return out.getvalue()


@contextlib.contextmanager
def thread_profiles() -> Iterator[list[cProfile.Profile]]:
    """cProfile of the calling thread and of every thread started inside the block
    (cProfile alone sees one thread: the readers would show as a lock's wait)."""
    profilers = [cProfile.Profile()]

    def start(*_: object) -> None:  # a new thread's first event: give it a profiler
        sys.setprofile(None)
        profiler = cProfile.Profile()
        profilers.append(profiler)
        profiler.enable()

    threading.setprofile(start)
    profilers[0].enable()
    try:
        yield profilers
    finally:
        profilers[0].disable()
        threading.setprofile(None)


# -- the run ------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=Path("bench-out/restore"))
    parser.add_argument("--tmpfs-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/restore_limit.json"))
    parser.add_argument("--profile", action="store_true", help="cProfile a cold and a warm restore")
    parser.add_argument(
        "--evict",
        choices=["auto", "fadvise"],
        default="auto",
        help="auto: drop_caches as root, else fadvise; fadvise: always (no global drop)",
    )
    parser.add_argument("--no-tmpfs", action="store_true", help="skip the tmpfs figures")
    parser.add_argument("--quick", action="store_true", help="a check that it runs: 0.05 GB, 1 rep")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gb, args.reps = 0.05, 1
    # This bench's catalog and ledger, not the user's (nor another bench's lock).
    state_home = Path(tempfile.mkdtemp(prefix="ckptvault-restore-state-"))
    os.environ["XDG_STATE_HOME"] = str(state_home)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    args.dir.mkdir(parents=True, exist_ok=True)
    model, opt = build(args.size_gb, width=width_for(args.size_gb))
    nbytes = state_bytes(model, opt)
    tmpfs = None if args.no_tmpfs else tmpfs_root(args.tmpfs_dir, nbytes)
    benches = {COLD: Bench(args.dir, model, opt, args.size_gb, args.evict)}
    benches[WARM] = benches[COLD]
    if tmpfs is not None:
        benches[TMPFS] = Bench(tmpfs, model, opt, args.size_gb, args.evict)
    del model, opt
    results: dict[str, list[Measurement]] = {}
    profiles: dict[str, str] = {}
    print(f"state: {nbytes / 1e9:.2f} GB; generation files {benches[COLD].file_bytes / 1e9:.2f} GB "
          f"in {len(benches[COLD].files)} files; {args.reps} repetitions", flush=True)  # fmt: skip
    try:
        for rep in range(args.reps):
            print(f"repetition {rep + 1}/{args.reps}", flush=True)
            for how in rotated(list(benches)):
                for name, measurement in benches[how].phase(how):
                    results.setdefault(name, []).append(measurement)
        if args.profile:
            for how in (COLD, WARM):
                profiles[how] = benches[how].profile(how, 25)
    finally:
        for bench in {id(b): b for b in benches.values()}.values():
            bench.close()
        if tmpfs is not None and args.tmpfs_dir is None:
            shutil.rmtree(tmpfs, ignore_errors=True)
        shutil.rmtree(state_home, ignore_errors=True)
    report(results, nbytes, benches[COLD], profiles, args)


# -- the report ---------------------------------------------------------------------------


def ratio_rows(median: dict[str, float], best: dict[str, float], name: str) -> tuple[str, str]:
    """The ratio column's two figures: cold, against the plain read (read s / this s);
    warm and tmpfs, where software is what is timed, against torch.load (torch s / this s)."""
    how = name.split(":")[0]
    base = f"{how}: {PLAIN}" if how == COLD else f"{how}: {TORCH}"
    if base not in median:
        return "", ""
    unit = "x plain read speed" if how == COLD else "x torch.load speed"
    return f"{median[base] / median[name]:.2f} {unit}", f"{best[base] / best[name]:.2f}"


def verdict(what: str, base: str, name: str, bound: float,
            median: dict[str, float], best: dict[str, float]) -> str:  # fmt: skip
    if name not in best or base not in best:
        return f"- {what}: not measured in this run"
    ratio, by_median = best[base] / best[name], median[base] / median[name]
    return (f"- {what}: {ratio:.2f}x by best runs ({best[name]:.3f} s vs {best[base]:.3f} s), "
            f"{by_median:.2f}x by medians (goal at least {bound}x): "
            f"{'met' if ratio >= bound else 'NOT met'}")  # fmt: skip


def report(results: dict[str, list[Measurement]], nbytes: int, bench: Bench,
           profiles: dict[str, str], args: argparse.Namespace) -> None:  # fmt: skip
    median = {n: statistics.median(s for s, _ in runs) for n, runs in results.items()}
    best = {n: min(s for s, _ in runs) for n, runs in results.items()}
    peak = {n: max(m for _, m in runs) for n, runs in results.items()}
    rows = []
    for name in sorted(results, key=lambda n: (n.split(":")[0], n)):
        by_median, by_best = ratio_rows(median, best, name)
        rows.append(f"| {name} | {median[name]:.3f} | {best[name]:.3f} | "
                    f"{nbytes / median[name] / 1e9:.2f} | {by_median} | {by_best} | "
                    f"{peak[name] / 1e6:.0f} |")  # fmt: skip
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
               f"Python {platform.python_version()}")  # fmt: skip
    methods = ", ".join(sorted(bench.methods)) or "none"
    goals = [
        verdict(f"cold verified restore >= {COLD_GOAL}x the plain sequential read",
                f"{COLD}: {PLAIN}", f"{COLD}: {VAULT}", COLD_GOAL, median, best),
        verdict(f"warm verified restore >= {WARM_GOAL}x torch.load+load_state_dict (torch s / ckptvault s)",
                f"{WARM}: {TORCH}", f"{WARM}: {VAULT}", WARM_GOAL, median, best),
    ]  # fmt: skip
    if f"{COLD}: {IN_PLACE}" in best:
        goals += [
            verdict("the same, cold, in_place=True", f"{COLD}: {PLAIN}",
                    f"{COLD}: {IN_PLACE}", COLD_GOAL, median, best),
            verdict("the same, warm, in_place=True", f"{WARM}: {TORCH}",
                    f"{WARM}: {IN_PLACE}", WARM_GOAL, median, best),
        ]  # fmt: skip
    lines = [
        f"State: {nbytes / 1e9:.2f} GB (model + AdamW; the generation's files "
        f"{bench.file_bytes / 1e9:.2f} GB in {len(bench.files)} files), {args.reps} interleaved "
        f"runs; cold pages evicted by {methods}; {machine}.",
        "",
        "| operation | median s | best s | GB/s (median) | ratio (medians) | ratio (best runs) "
        "| peak extra RSS (MB) |",
        "|---|---:|---:|---:|---|---:|---:|",
        *rows,
        "",
        "Goals, judged on best runs:",
        "",
        *goals,
    ]
    text = "\n".join(lines)
    print()
    print(text)
    for how, profile in profiles.items():
        print(f"\ncProfile of one {how} ckptvault restore:\n{profile}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "bytes": nbytes, "file_bytes": bench.file_bytes, "machine": machine, "reps": args.reps,
        "cold_method": methods,
        "results": {n: {"seconds": r, "median": median[n], "best": best[n]} for n, r in results.items()},
        "table": text, "profiles": profiles,
    }, indent=2))  # fmt: skip


if __name__ == "__main__":
    main()
