"""POSIX file primitives for the store: descriptor-relative, link-refusing, durable.

Everything below a store's root is reached through directory descriptors with
``O_NOFOLLOW`` and checked with ``fstat`` after opening, so a link or FIFO planted
in the store is refused instead of followed; new files are written unbuffered with
write-behind and made durable (and read-only) on commit.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from ckptvault.errors import CheckpointError, SaveFailedError, StorageFullError, UnsafeEntryError


class PosixRoot(Protocol):
    """What the helpers of this package need of a POSIX store (:class:`~ckptvault.storage.posix.store.PosixStore`
    is one): its root, and descriptors of the root and the staging directory. The
    store imports them, never the other way round."""

    root: Path
    location: str

    def open_root(self) -> int: ...

    def open_staging_dir(self) -> int: ...

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
WRITE_BEHIND_BYTES = 8 * 1024 * 1024
MAX_CLEANUP_DEPTH = 16  # staging areas are flat; deeper trees were planted

# O_NONBLOCK: a FIFO planted where a directory belongs never blocks the open.
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _load_sync_file_range() -> Callable[[int, int, int], None] | None:
    """``sync_file_range(SYNC_FILE_RANGE_WRITE)`` where the C library has it: start
    writing dirty pages back now, without waiting, so the disk works while the CPU
    hashes the next piece and the final fsync has little left to do."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int

    def start_writeback(fd: int, offset: int, count: int) -> None:
        function(fd, offset, count, 2)  # SYNC_FILE_RANGE_WRITE; a failure only loses the hint

    return start_writeback


_start_writeback = _load_sync_file_range()


def translate_os_error(exc: OSError, what: str) -> CheckpointError:
    """Map an OS error during a save to a typed ckptvault error."""
    if exc.errno in _FULL_ERRNOS:
        return StorageFullError(
            f"{what}: the filesystem is full or over quota ({exc.strerror}). Nothing was "
            "published and earlier generations are intact; free space or keep fewer "
            "generations (retention=cv.Retention(keep_last=...)), then save again."
        )
    return SaveFailedError(f"{what}: {exc.strerror or exc} ({type(exc).__name__})")


def printable_name(name: str) -> str:
    """``name`` when it is plain printable UTF-8, else an escaped ASCII rendering that
    is safe in messages, JSON and terminals (non-UTF-8 bytes and control characters)."""
    if name.isprintable():
        try:
            name.encode("utf-8")
            return name
        except UnicodeEncodeError:
            pass
    decoded = os.fsencode(name).decode("utf-8", "backslashreplace")
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in decoded)


def describe_unsafe(info: os.stat_result) -> str | None:
    """Why an entry is not a plain, singly linked file, or None when it is one.

    Sparse files are not refused: compressing filesystems (ZFS, btrfs) report runs of
    zeros, such as a fresh optimizer's moments, as unallocated too. A forged manifest
    describing a huge sparse file costs readers time (hashing zeros) and, at worst,
    an allocation failure, which rejects that generation: denial of service, which
    write access to the store allows anyway."""
    mode = info.st_mode
    if stat.S_ISLNK(mode):
        return "is a symlink"
    if stat.S_ISDIR(mode):
        return "is a directory"
    if not stat.S_ISREG(mode):
        return "is a FIFO, socket or device"
    if info.st_nlink != 1:
        return f"is hard-linked ({info.st_nlink} names share it)"
    return None


@contextlib.contextmanager
def opened(fd: int) -> Iterator[int]:
    try:
        yield fd
    finally:
        os.close(fd)


def open_dir(name: str, dir_fd: int, where: str) -> int:
    """Open a directory entry without following a link; UnsafeEntryError if it is not one."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeEntryError(
                f"{where} is not a directory (a symlink or file was put in its place); "
                "ckptvault does not follow it. Remove it, or restore the store from a copy"
            ) from exc
        raise


def remove_tree(parent_fd: int, name: str, depth: int = 0) -> bool:
    """Delete ``name`` below ``parent_fd``, never following a link out of it; best
    effort: returns False when something could not be removed (and stays).

    A symlink is unlinked, not followed; directories are walked through descriptors.
    Trees deeper than staging areas ever are stop the walk rather than exhaust the
    stack. Cleanup must never turn a save (or its real error) into a cleanup error.
    """
    try:
        info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode):
            os.unlink(name, dir_fd=parent_fd)
            return True
        if depth >= MAX_CLEANUP_DEPTH:
            return False
        fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)  # a link swapped in: refused
        with opened(fd):
            removed = all([remove_tree(fd, child, depth + 1) for child in os.listdir(fd)])
        os.rmdir(name, dir_fd=parent_fd)
        return removed
    except FileNotFoundError:
        return True
    except OSError:
        return False


class PosixWritableFile:
    """An unbuffered new file in a staging directory; ``commit`` makes it durable."""

    def __init__(self, dir_fd: int, name: str, where: str) -> None:
        self.where = where
        self._fd = os.open(
            name,
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
            0o644,
            dir_fd=dir_fd,
        )
        self._written = 0
        self._flushed = 0  # bytes already handed to write-behind

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        written = 0
        try:
            while written < len(view):
                written += os.write(self._fd, view[written:])
        except OSError as exc:
            raise translate_os_error(exc, f"writing {self.where}") from exc
        self._written += written
        if _start_writeback is not None and self._written - self._flushed >= WRITE_BEHIND_BYTES:
            _start_writeback(self._fd, self._flushed, self._written - self._flushed)
            self._flushed = self._written
        return written

    def commit(self) -> None:
        try:
            # Published files are read-only: a generation is never modified.
            os.fchmod(self._fd, 0o444)
            os.fsync(self._fd)
        except OSError as exc:
            raise translate_os_error(exc, f"syncing {self.where}") from exc
        finally:
            self._close()

    def abort(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def newest_change(parent_fd: int, name: str) -> float:
    """The newest modification time of ``name`` and (for a directory) its direct
    entries: when a staging area was last written to."""
    info = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
    newest = info.st_mtime
    if stat.S_ISDIR(info.st_mode):
        try:
            fd = os.open(name, DIR_FLAGS, dir_fd=parent_fd)
        except OSError:
            return newest
        with opened(fd):
            for child in os.listdir(fd):
                with contextlib.suppress(OSError):
                    child_info = os.stat(child, dir_fd=fd, follow_symlinks=False)
                    newest = max(newest, child_info.st_mtime)
    return newest


def read_small_file(dir_fd: int, name: str, limit: int) -> bytes:
    """A plain file's bytes (at most ``limit``), opened without following links."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    with opened(fd):
        info = os.fstat(fd)
        unsafe = describe_unsafe(info)
        if unsafe is not None:
            raise UnsafeEntryError(f"{name} {unsafe}; refusing to read it")
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"{name} is larger than {limit} bytes")
        return os.pread(fd, info.st_size, 0)
