"""Measuring tools shared by the benchmarks: peak resident memory, cold page cache,
scratch paths, and a timer that starts every measurement from a quiet disk."""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

PAGE = os.sysconf("SC_PAGE_SIZE")
T = TypeVar("T")


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


class PeakRSS:
    """Samples resident memory on a thread; ``extra`` is the peak above the start."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.extra = 0

    def __enter__(self) -> PeakRSS:
        self._start = rss_bytes()
        self._peak = self._start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, rss_bytes())
        self.extra = self._peak - self._start


def files_under(path: Path) -> list[Path]:
    return [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]


def fsync_path(path: Path) -> None:
    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_caches(path: Path) -> str:
    """Evict ``path``'s pages so the next read comes from the disk: the whole page
    cache as root, else (and in a smoke run) ``path``'s files with fadvise."""
    sync_all()
    if not SMOKE:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as handle:
                handle.write("3\n")
            return "drop_caches"
        except OSError:
            pass
    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


@contextlib.contextmanager
def scratch(root: Path, name: str) -> Iterator[Path]:
    """A path under ``root`` that is gone before and after the block."""
    path = root / name
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        path.unlink()
    try:
        yield path
    finally:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()


# Seconds to let the disk settle after the sync; the test suite's smoke runs, which
# check that a benchmark runs and not what it measures, set 0.
QUIET_SECONDS = float(os.environ.get("CKPTVAULT_BENCH_QUIET_SECONDS", "0.3"))
# A smoke run neither syncs the whole system nor drops its page cache: both reach
# every other test running beside it (a dropped cache makes each new process read
# torch's libraries from the disk again).
SMOKE = QUIET_SECONDS <= 0


def sync_all() -> None:
    """``os.sync()``: every dirty page of the system to the disk (not in a smoke run)."""
    if not SMOKE:
        os.sync()


def quiesce() -> None:
    """Start every measurement from a quiet disk: no dirty pages left by the last one."""
    if SMOKE:
        return
    os.sync()
    time.sleep(QUIET_SECONDS)


def timed(fn: Callable[[], object]) -> tuple[float, int]:
    """Seconds ``fn`` takes and the peak extra resident memory while it runs."""
    gc.collect()
    # What survives (torch's modules and all) leaves the collector's view: a full
    # collection walked a million objects, 0.2 s each time here, and one could start
    # inside ``fn``. A frozen object is still freed when its last reference goes;
    # only a cycle among them would outlive its use (none that matters here).
    gc.freeze()
    quiesce()
    with PeakRSS() as peak:
        started = time.perf_counter()
        fn()
        seconds = time.perf_counter() - started
    return seconds, peak.extra


_rotation = itertools.count()


def rotated(items: Sequence[T]) -> list[T]:
    """``items`` starting one further along on every call: over the repetitions each
    contender runs first, second, ... equally often, so no one always gets the
    quiet (or the busy) slot."""
    shift = next(_rotation) % max(1, len(items))
    return list(items[shift:]) + list(items[:shift])
