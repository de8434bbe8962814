"""Drills of the storage underneath: full, and slow.

- storage full: the newest generation is copied into a small tmpfs (mounting one
  needs root); a save bigger than what is left fails with ``StorageFullError``,
  the generations already published are unchanged, and restore still takes the
  newest. Skipped, with the reason, where a tmpfs cannot be mounted.
- slow storage: writes are throttled to 10% of the speed one unthrottled save
  measured here (a save then lasts 10x as long, kept between
  :data:`MIN_THROTTLED_S` and :data:`MAX_THROTTLED_S`), by a store wrapper that
  sleeps per write. An
  asynchronous save must then stall the caller for about one memory copy, not the
  write; with ``if_busy="wait"`` the next save waits for the one in flight, with
  ``"skip"`` it is skipped and counted in ``stats.saves_skipped``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from ckptvault.errors import StorageFullError
from ckptvault.ops.drills.base import Drill, DrillSkipped, timed_restore
from ckptvault.ops.drills.context import DrillContext
from ckptvault.ops.drills.synthetic import ballast_state
from ckptvault.storage import open_store
from ckptvault.storage.base import StagingArea, Store, WritableFile

Outcome = tuple[bool, str, dict[str, float]]
MAX_TMPFS_BYTES = 256 << 20  # the storage-full drill copies the newest generation into RAM
# A throttled save lasts 10x an unthrottled one, kept within these bounds: long
# enough that a stall the length of the write is unmistakable, short enough for a drill.
MIN_THROTTLED_S, MAX_THROTTLED_S = 0.6, 1.5
STALL_ALLOWANCE_S = 0.1  # fixed costs of an async save besides capture and copy


def _tree_listing(store: Path) -> dict[str, int]:
    return {
        str(path.relative_to(store)): path.stat().st_size
        for path in sorted(store.rglob("*"))
        if path.is_file() and not path.relative_to(store).parts[0].startswith(".")
    }


def _mount_tmpfs(mount: Path, size: int) -> None:
    mount.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        why = result.stderr.strip() or f"mount exited {result.returncode}"
        raise DrillSkipped(f"cannot mount a small tmpfs here: {why}")


def _storage_full_drill(context: DrillContext) -> Outcome:
    if os.geteuid() != 0:
        raise DrillSkipped("mounting a small tmpfs needs root (CAP_SYS_ADMIN)")
    if shutil.which("mount") is None:
        raise DrillSkipped("no mount command on this machine")
    label = "storage-full"
    newest = context.generations(context.base)[0]
    size = sum(p.stat().st_size for p in Path(newest.location).iterdir())
    if size > MAX_TMPFS_BYTES:
        raise DrillSkipped(f"the newest generation ({size} bytes) is too big to copy into RAM")
    capacity = (size + (2 << 20) + 4095) // 4096 * 4096
    mount = context.workdir(label) / "small-fs"
    _mount_tmpfs(mount, capacity)
    try:
        store = mount / "store"
        store.mkdir()
        shutil.copytree(newest.location, store / newest.name.dirname)
        before = _tree_listing(store)
        error: Exception | None = None
        state, strict = context.new_state()
        with context.manager(store, label) as manager:
            try:
                manager.save(newest.step + 1, ballast_state(2 * capacity))
            except Exception as exc:  # the drill checks which
                error = exc
            after = _tree_listing(store)
            outcome = timed_restore(manager, state, strict)
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)
    info = outcome.info
    passed = (
        isinstance(error, StorageFullError)
        and before == after
        and info is not None
        and info.generation_id == newest.generation_id
    )
    said = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}" if error else "no error"
    observed = (
        f"a save of {2 * capacity} bytes into a {capacity}-byte tmpfs raised {said}; published "
        f"files {'unchanged' if before == after else 'CHANGED'}; {outcome.describe()}"
    )
    return passed, observed, outcome.timings


class _Throttle:
    """Shared by every file of a store: the writes of all threads together go at
    ``bytes_per_s`` at most."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self._next_free = 0.0

    def consume(self, nbytes: int) -> None:
        if self.bytes_per_s is None:
            return
        with self._lock:
            start = max(time.perf_counter(), self._next_free)
            self._next_free = start + nbytes / self.bytes_per_s
            until = self._next_free
        time.sleep(max(0.0, until - time.perf_counter()))


class _ThrottledFile:
    def __init__(self, inner: WritableFile, throttle: _Throttle) -> None:
        self._inner, self._throttle = inner, throttle

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._throttle.consume(memoryview(data).nbytes)
        return self._inner.write(data)

    def commit(self) -> None:
        self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


class _ThrottledArea:
    def __init__(self, inner: StagingArea, throttle: _Throttle) -> None:
        self._inner, self._throttle = inner, throttle
        self.generation_id = inner.generation_id

    def create_file(self, name: str) -> WritableFile:
        return _ThrottledFile(self._inner.create_file(name), self._throttle)

    def __getattr__(self, name: str) -> Any:  # publish, abort, release, adopt
        return getattr(self._inner, name)


class ThrottledStore:
    """A store whose staging writes are throttled (a slow disk or network); every
    other call goes to ``inner`` unchanged."""

    def __init__(self, inner: Store, bytes_per_s: float | None = None) -> None:
        self._inner = inner
        self.location = inner.location
        self.throttle = _Throttle(bytes_per_s)

    def begin_generation(self, generation_id: str) -> StagingArea:
        return _ThrottledArea(self._inner.begin_generation(generation_id), self.throttle)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _copy_seconds(state: dict[str, Any]) -> tuple[float, float, int]:
    """How long capturing the state and one copy of its tensors into ready buffers
    take (the two costs of an async save's stall), and the tensors' bytes."""
    from ckptvault.state.capture import capture_state

    started = time.perf_counter()
    tensors = list(capture_state(state).tensors.values())
    capture_s = time.perf_counter() - started
    buffers = [torch.empty_like(t) for t in tensors]
    seconds = []
    for _ in range(3):  # the first copy also faults the buffers in; staging's are ready
        started = time.perf_counter()
        for buffer, tensor in zip(buffers, tensors, strict=True):
            buffer.copy_(tensor)
        seconds.append(time.perf_counter() - started)
    return capture_s, min(seconds), sum(t.numel() * t.element_size() for t in tensors)


def _slow_storage_drill(context: DrillContext) -> Outcome:
    label = "slow-storage"
    state = context.state_to_save()
    capture_s, copy_s, nbytes = _copy_seconds(state)
    store = ThrottledStore(open_store(context.workdir(label) / "store"))
    with context.manager(store, label) as manager:
        started = time.perf_counter()
        manager.save(1, state)
        normal_s = time.perf_counter() - started
    rate = nbytes / min(max(10 * normal_s, MIN_THROTTLED_S), MAX_THROTTLED_S)
    store.throttle.bytes_per_s = rate
    bound = 2 * capture_s + 4 * copy_s + STALL_ALLOWANCE_S
    options: dict[str, Any] = {"async_save": True, "max_in_flight": 1}
    with context.manager(store, label, if_busy="wait", **options) as manager:
        manager.prepare(state, wait=True)
        first = manager.save(2, state)
        second = manager.save(3, state)  # one in flight already: waits for it
        manager.wait()
        waited = [first.stall_seconds, second.stall_seconds]
    with (
        warnings.catch_warnings(record=True),
        context.manager(store, label, if_busy="skip", **options) as manager,
    ):
        manager.prepare(state, wait=True)
        manager.save(4, state)
        skipped = manager.save(5, state)  # one in flight: skipped, counted
        manager.wait()
        skips = manager.stats.saves_skipped
    throttled_s = nbytes / rate
    passed = (
        waited[0] <= bound and waited[1] >= 0.5 * throttled_s and skipped.skipped and skips == 1
    )
    observed = (
        f"writes throttled to {rate / 1e6:.1f} MB/s ({100 * rate * normal_s / nbytes:.0f}% of "
        f"{nbytes / normal_s / 1e6:.1f} MB/s); async stall {waited[0]:.3f} s (bound "
        f"{bound:.3f} s: 2 x a {capture_s:.4f} s capture, 4 x a {copy_s:.4f} s memory copy, "
        f"+ {STALL_ALLOWANCE_S} s) against a "
        f"{throttled_s:.2f} s write; if_busy=wait: next save waited {waited[1]:.2f} s; "
        f"if_busy=skip: next save {'skipped' if skipped.skipped else 'NOT skipped'}, "
        f"saves_skipped={skips}"
    )
    timings = {
        "stall": waited[0],
        "stall_bound": bound,
        "copy": copy_s,
        "capture": capture_s,
        "normal_save": normal_s,
        "throttled_write": throttled_s,
        "wait_stall": waited[1],
    }
    return passed, observed, timings


STORAGE_DRILLS = [
    Drill(
        "storage-full",
        "a save into a full filesystem raises StorageFullError; published generations "
        "unchanged and the newest still restores",
        _storage_full_drill,
    ),
    Drill(
        "slow-storage",
        "writes at 10% speed: async stall about one memory copy; if_busy=wait waits, "
        "if_busy=skip skips and counts",
        _slow_storage_drill,
    ),
]
