"""Simulated power loss: the ``os`` wrappers a :class:`power_loss.Recorder` installs.

Each wrapper places its arguments in the recorder's model *before* the real call
(a name is resolved while it still means what the caller meant), makes the real
call, and only when it succeeded logs what it changed. Calls on paths and
descriptors outside the world pass straight through. A call the model cannot place
is noted in ``recorder.errors`` (never raised into ckptvault, whose own error
handling must not be what the test exercises). Every wrapper holds the recorder's
lock across the real call, so the log's order is the order the calls happened in.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from support.power_loss import AddName, Chmod, ModelError, Sync, Truncate, Write

if TYPE_CHECKING:
    from support.power_loss import Recorder

NAMES = (
    "open", "close", "write", "pwrite", "ftruncate", "truncate", "fsync", "fdatasync",
    "fchmod", "chmod", "mkdir", "rename", "replace", "link", "unlink", "remove", "rmdir",
    "symlink", "fdopen",
)  # fmt: skip


def _bytes(data: Any, count: int) -> bytes:
    return memoryview(data).tobytes()[:count]


def wrappers(rec: Recorder) -> dict[str, Callable[..., Any]]:
    """The wrapper of every function in :data:`NAMES`, bound to ``rec``."""
    return Wrappers(rec).by_name()


class Wrappers:
    def __init__(self, rec: Recorder) -> None:
        self.rec = rec
        self.real = {name: getattr(os, name) for name in NAMES}
        self.lseek = os.lseek
        self.unplaced: list[str] = []  # under rec._lock: about the call wrapped now

    def by_name(self) -> dict[str, Callable[..., Any]]:
        special = {
            "open": self.open_,
            "rename": functools.partial(self.move, "rename"),
            "replace": functools.partial(self.move, "replace"),
            "unlink": functools.partial(self.unlink, "unlink"),
            "remove": functools.partial(self.unlink, "remove"),
            "rmdir": functools.partial(self.unlink, "rmdir"),
        }
        return {name: special.get(name) or getattr(self, name) for name in NAMES}

    # -- bookkeeping ---------------------------------------------------------------------

    def placed(self, what: str, function: Callable[[], Any]) -> Any:
        """``function()`` (model bookkeeping); a ModelError is noted, not raised. It
        counts only if the real call succeeds (``mkdir(parents=True)`` tries first)."""
        try:
            return function()
        except (ModelError, KeyError) as exc:
            self.unplaced.append(f"{what}: {exc!r}")
            return None

    def call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            result = self.real[name](*args, **kwargs)
        except BaseException:
            self.unplaced.clear()
            raise
        self.rec.errors.extend(self.unplaced)
        self.unplaced.clear()
        return result

    def target(self, path: Any, dir_fd: int | None) -> int | None:
        """The inode a path (or descriptor) names; None outside the world."""
        if isinstance(path, int):
            return self.rec._fds.get(path)
        return self.placed(f"{path}", lambda: self.rec.resolve(path, dir_fd))

    # -- opening and closing -------------------------------------------------------------

    def open_(self, path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None):
        rec = self.rec
        with rec._lock:
            start = self.placed(f"open {path}", lambda: rec._start(path, dir_fd))
            existing = self.placed(f"open {path}", lambda: _lookup(rec, start)) if start else None
            fd = self.call("open", path, flags, mode, dir_fd=dir_fd)
            if start is None:
                return fd
            if existing is None and not flags & os.O_CREAT:
                rec.errors.append(f"open {path}: the model does not hold it")
            elif existing is None:
                existing = self.placed(f"create {path}", lambda: _created(rec, path, dir_fd, fd))
            elif flags & os.O_TRUNC and existing not in rec._entries:
                rec.log.append(Truncate(existing, 0))
            if existing is not None:
                rec._fds[fd] = existing
            return fd

    def close(self, fd: int) -> None:
        with self.rec._lock:
            self.rec._fds.pop(fd, None)
            self.call("close", fd)

    def fdopen(self, fd: int, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        with self.rec._lock:
            if fd in self.rec._fds and any(c in mode for c in "wax+"):
                self.rec.errors.append(f"fdopen({fd}, {mode!r}): writes through io are unmodelled")
            self.rec._fds.pop(fd, None)  # io closes it without os.close
            return self.call("fdopen", fd, mode, *args, **kwargs)

    # -- file contents -------------------------------------------------------------------

    def write(self, fd: int, data: Any) -> int:
        with self.rec._lock:
            count = self.call("write", fd, data)
            if fd in self.rec._fds:
                end = self.lseek(fd, 0, os.SEEK_CUR)  # O_APPEND too: where the bytes went
                self.rec.log.append(Write(self.rec._fds[fd], end - count, _bytes(data, count)))
            return count

    def pwrite(self, fd: int, data: Any, offset: int) -> int:
        with self.rec._lock:
            count = self.call("pwrite", fd, data, offset)
            if fd in self.rec._fds:
                self.rec.log.append(Write(self.rec._fds[fd], offset, _bytes(data, count)))
            return count

    def ftruncate(self, fd: int, size: int) -> None:
        with self.rec._lock:
            self.call("ftruncate", fd, size)
            if fd in self.rec._fds:
                self.rec.log.append(Truncate(self.rec._fds[fd], size))

    def truncate(self, path: Any, size: int) -> None:
        with self.rec._lock:
            inode = self.target(path, None)
            self.call("truncate", path, size)
            if inode is not None:
                self.rec.log.append(Truncate(inode, size))

    def fsync(self, fd: Any) -> None:
        self._sync("fsync", fd)

    def fdatasync(self, fd: Any) -> None:
        self._sync("fdatasync", fd)

    def _sync(self, name: str, fd: Any) -> None:
        number = fd if isinstance(fd, int) else fd.fileno()
        with self.rec._lock:
            self.call(name, fd)
            if number in self.rec._fds:
                self.rec.log.append(Sync(self.rec._fds[number]))

    def fchmod(self, fd: int, mode: int) -> None:
        with self.rec._lock:
            self.call("fchmod", fd, mode)
            if fd in self.rec._fds:
                actual = stat.S_IMODE(os.fstat(fd).st_mode)
                self.rec.log.append(Chmod(self.rec._fds[fd], actual))

    def chmod(
        self, path: Any, mode: int, *, dir_fd: int | None = None, follow_symlinks: bool = True
    ) -> None:
        with self.rec._lock:
            inode = self.target(path, dir_fd)
            self.call("chmod", path, mode, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
            if inode is not None:
                self.rec.log.append(Chmod(inode, self.rec._mode_of(path, dir_fd)))

    # -- directory entries ---------------------------------------------------------------

    def mkdir(self, path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        rec = self.rec
        with rec._lock:
            where = self.placed(f"mkdir {path}", lambda: rec.locate(path, dir_fd))
            self.call("mkdir", path, mode, dir_fd=dir_fd)
            if where is not None:
                made = AddName(*where, rec._new_inode(), "dir", rec._mode_of(path, dir_fd))
                rec._add(made)

    def move(
        self,
        name: str,
        src: Any,
        dst: Any,
        *,
        src_dir_fd: int | None = None,
        dst_dir_fd: int | None = None,
    ) -> None:
        rec = self.rec
        with rec._lock:
            old = self.placed(f"{name} {src}", lambda: rec.locate(src, src_dir_fd))
            new = self.placed(f"{name} {dst}", lambda: rec.locate(dst, dst_dir_fd))
            self.call(name, src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
            if (old is None) != (new is None):
                rec.errors.append(f"{name} {src} -> {dst} crosses the world's edge")
            elif old is not None and new is not None:
                self.placed(f"{name} {src}", lambda: _renamed(rec, old, new))

    def link(
        self,
        src: Any,
        dst: Any,
        *,
        src_dir_fd: int | None = None,
        dst_dir_fd: int | None = None,
        follow_symlinks: bool = True,
    ) -> None:
        rec = self.rec
        with rec._lock:
            inode = self.target(src, src_dir_fd)
            new = self.placed(f"link {dst}", lambda: rec.locate(dst, dst_dir_fd))
            self.call(
                "link", src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd,
                follow_symlinks=follow_symlinks,
            )  # fmt: skip
            if inode is not None and new is not None:
                rec._add(AddName(*new, inode))

    def unlink(self, name: str, path: Any, *, dir_fd: int | None = None) -> None:
        rec = self.rec
        with rec._lock:
            where = self.placed(f"{name} {path}", lambda: rec.locate(path, dir_fd))
            self.call(name, path, dir_fd=dir_fd)
            if where is not None:
                self.placed(f"{name} {path}", lambda: rec._remove(*where))

    def symlink(
        self, src: Any, dst: Any, target_is_directory: bool = False, *, dir_fd: int | None = None
    ) -> None:
        with self.rec._lock:
            if self.rec._start(dst, dir_fd) is not None:
                self.rec.errors.append(f"symlink {dst}: links are not modelled")
            self.call("symlink", src, dst, target_is_directory, dir_fd=dir_fd)


def _lookup(rec: Recorder, start: tuple[int, list[str]]) -> int | None:
    """The inode a path names, or None when its last component does not exist."""
    inode, parts = start
    if not parts:
        return inode
    directory = rec._walk(inode, parts[:-1], "/".join(parts))
    return rec._entries[directory].get(parts[-1])


def _created(rec: Recorder, path: Any, dir_fd: int | None, fd: int) -> int:
    where = rec.locate(path, dir_fd)
    assert where is not None
    info = os.fstat(fd)
    kind = "dir" if stat.S_ISDIR(info.st_mode) else "file"
    inode = rec._new_inode()
    rec._add(AddName(*where, inode, kind, stat.S_IMODE(info.st_mode)))
    return inode


def _renamed(rec: Recorder, old: tuple[int, str], new: tuple[int, str]) -> None:
    inode = rec._entries[old[0]][old[1]]
    if rec._entries[new[0]].get(new[1]) == inode:
        return  # rename onto itself: nothing happens
    pair = rec._next_rename
    rec._next_rename += 1
    rec._remove(*old, rename=pair)
    rec._add(AddName(*new, inode, rename=pair))
