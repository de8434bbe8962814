"""Guards that watch a reader while it meets a hostile generation: what it opens,
whether anything outside the store is read, and how much memory it takes.

- :class:`AccessLog` is a ``sys.addaudithook`` hook: every ``open``, directory
  listing, SQLite connection and filesystem change the process makes while it is
  active, with the path as given. :meth:`AccessLog.escapes` says which of them
  reach outside the allowed roots (the store and the control plane) into the test's
  own directory tree, where the secrets lie, or use a path with a traversal in it.
- :class:`InodeWatch` is inotify on the secret files and directories themselves:
  it sees an open or a read of their inodes by any process (a CLI subprocess too)
  and through any name (a symlink, a hard link, a ``..`` path), which is what a
  path check alone cannot.
- :class:`MemoryMeter` measures a call's peak: Python allocations (tracemalloc) and
  the process's resident set (``VmHWM`` after resetting it through
  ``/proc/self/clear_refs``, or ``VmRSS`` at the end where that is higher), which
  counts native allocations (torch, numpy) that tracemalloc does not see.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct
import sys
import tracemalloc
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

# Audit events that name a path the process reads, lists or changes.
_PATH_EVENTS = {
    "open": 0,
    "os.listdir": 0,
    "os.scandir": 0,
    "sqlite3.connect": 0,
    "os.remove": 0,
    "os.rmdir": 0,
    "os.mkdir": 0,
    "os.rename": 1,  # the destination; the source is checked as well below
    "os.link": 1,
    "os.symlink": 1,
    "os.truncate": 0,
    "os.chmod": 0,
    "shutil.copyfile": 1,
    "shutil.rmtree": 0,
}
_TWO_PATHS = {"os.rename", "os.link", "shutil.copyfile"}


class AccessLog:
    """Records paths the process touches while :meth:`watching` is active.

    One hook is installed per process (audit hooks cannot be removed); it does
    nothing while no log is active.
    """

    _active: AccessLog | None = None
    _installed = False

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    @classmethod
    def _hook(cls, event: str, args: tuple) -> None:
        log = cls._active
        if log is None or event not in _PATH_EVENTS:
            return
        positions = (0, 1) if event in _TWO_PATHS else (_PATH_EVENTS[event],)
        for position in positions:
            if position < len(args):
                path = args[position]
                if isinstance(path, (str, bytes, os.PathLike)):
                    log.events.append((event, os.fsdecode(path)))

    @contextlib.contextmanager
    def watching(self) -> Iterator[AccessLog]:
        if not AccessLog._installed:
            sys.addaudithook(AccessLog._hook)
            AccessLog._installed = True
        previous, AccessLog._active = AccessLog._active, self
        try:
            yield self
        finally:
            AccessLog._active = previous

    def escapes(self, watched_tree: Path, allowed: Iterable[Path]) -> list[str]:
        """Paths recorded that lie in ``watched_tree`` (the test's own directory
        tree, where the store, the control plane and the secrets are) but under none
        of ``allowed``, and relative paths that are more than one plain component
        (readers open store entries by one name, relative to a directory
        descriptor). Paths elsewhere (the interpreter, libraries, /proc) are fine."""
        tree = os.path.normpath(watched_tree)
        roots = [os.path.normpath(root) for root in allowed]
        found = []
        for event, path in self.events:
            if not os.path.isabs(path):
                if "/" in path or path in ("..", "."):
                    found.append(f"{event} {path!r} (a relative path with more than one name)")
                continue
            norm = os.path.normpath(path)
            if ".." in Path(path).parts:
                found.append(f"{event} {path!r} (a path with '..' in it)")
            elif _under(norm, tree) and not any(_under(norm, root) for root in roots):
                found.append(f"{event} {path!r}")
        return found


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


# -- inotify ---------------------------------------------------------------------------

IN_ACCESS = 0x001
IN_OPEN = 0x020
_EVENT = struct.Struct("iIII")


@dataclass
class InodeWatch:
    """inotify watches for opens (``IN_OPEN``) and reads (``IN_ACCESS``) of every
    file and directory under ``root``, by any process and through any name."""

    root: Path
    _fd: int = -1
    _names: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        for path in [self.root, *sorted(self.root.rglob("*"))]:
            if path.is_symlink() or not (path.is_file() or path.is_dir()):
                continue  # a link is not the secret; a FIFO is never opened by the test
            wd = libc.inotify_add_watch(self._fd, os.fsencode(path), IN_OPEN | IN_ACCESS)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {path}")
            self._names[wd] = str(path)

    def drain(self) -> list[str]:
        """The events since the last drain, as ``"open <path>"`` / ``"read <path>"``."""
        seen = []
        while True:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                return seen
            offset = 0
            while offset < len(data):
                wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
                name = data[offset + _EVENT.size : offset + _EVENT.size + length].rstrip(b"\0")
                where = self._names.get(wd, "?") + ("/" + os.fsdecode(name) if name else "")
                kind = "read" if mask & IN_ACCESS else "open"
                seen.append(f"{kind} {where}")
                offset += _EVENT.size + length

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


# -- memory ----------------------------------------------------------------------------


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise LookupError(field_name)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")  # resets VmHWM to the current resident set (Linux >= 4.0)
        return True
    except OSError:
        return False


@dataclass
class MemoryPeak:
    python: int = 0  # bytes, tracemalloc's peak above the start
    resident: int | None = None  # bytes the resident set grew at its peak; None: unknown


@contextlib.contextmanager
def memory_meter(trace_python: bool = True) -> Iterator[MemoryPeak]:
    """The peak memory of the block (see the module docstring). ``trace_python``:
    also trace Python's allocations (it slows the block down about twofold)."""
    peak = MemoryPeak()
    measured_rss = _reset_peak_rss()
    rss_before = _status_kib("VmRSS") if measured_rss else 0
    if trace_python:
        tracemalloc.start()
    start, _ = tracemalloc.get_traced_memory()
    try:
        yield peak
    finally:
        if trace_python:
            _, top = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            peak.python = top - start
        if measured_rss:
            # VmHWM can lag the resident set (a kernel that folds per-thread RSS
            # counts into the process's only now and then missed 64 MiB in CI),
            # so what is resident at the end counts as well.
            top_kib = max(_status_kib("VmHWM"), _status_kib("VmRSS"))
            peak.resident = max(0, top_kib - rss_before) * 1024
