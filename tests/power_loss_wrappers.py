"""Simulated power loss: the ``os`` wrappers a :class:`power_loss.Recorder` installs.

Each wrapper places its arguments in the recorder's model *before* the real call
(a name is resolved while it still means what the caller meant), makes the real
call, and only when it succeeded logs what it changed. Calls on paths and
descriptors outside the world pass straight through. A call the model cannot place
is noted in ``recorder.errors`` (never raised into ckptvault, whose own error
handling must not be what the test exercises).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from power_loss import AddName, Chmod, ModelError, Sync, Truncate, Write

if TYPE_CHECKING:
    from power_loss import Recorder

NAMES = (
    "open", "close", "write", "pwrite", "ftruncate", "truncate", "fsync", "fdatasync",
    "fchmod", "chmod", "mkdir", "rename", "replace", "link", "unlink", "remove", "rmdir",
    "symlink", "fdopen",
)  # fmt: skip


def _bytes(data: Any, count: int) -> bytes:
    return memoryview(data).tobytes()[:count]


def wrappers(rec: Recorder) -> dict[str, Callable[..., Any]]:
    """The wrapper of every function in :data:`NAMES`, bound to ``rec``."""
    real = {name: getattr(os, name) for name in NAMES}
    lseek = os.lseek

    unplaced: list[str] = []  # under rec._lock: the call being wrapped now

    def placed(what: str, function: Callable[[], Any]) -> Any:
        """``function()`` (model bookkeeping); a ModelError is noted, not raised. It
        counts only if the real call succeeds (``mkdir(parents=True)`` tries first)."""
        try:
            return function()
        except (ModelError, KeyError) as exc:
            unplaced.append(f"{what}: {exc!r}")
            return None

    def call(name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            result = real[name](*args, **kwargs)
        except BaseException:
            unplaced.clear()
            raise
        rec.errors.extend(unplaced)
        unplaced.clear()
        return result

    def open_(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
        with rec._lock:
            start = placed(f"open {path}", lambda: rec._start(path, dir_fd))
            existing = placed(f"open {path}", lambda: _lookup(rec, start)) if start else None
            fd = call("open", path, flags, mode, dir_fd=dir_fd)
            if start is None:
                return fd
            if existing is None and not flags & os.O_CREAT:
                rec.errors.append(f"open {path}: the model does not hold it")
            elif existing is None:
                existing = placed(f"create {path}", lambda: _created(rec, path, dir_fd, fd))
            elif flags & os.O_TRUNC and existing not in rec._entries:
                rec.log.append(Truncate(existing, 0))
            if existing is not None:
                rec._fds[fd] = existing
            return fd

    def close(fd: int) -> None:
        with rec._lock:
            rec._fds.pop(fd, None)
            call("close", fd)

    def write(fd: int, data: Any) -> int:
        with rec._lock:
            count = call("write", fd, data)
            if fd in rec._fds:
                end = lseek(fd, 0, os.SEEK_CUR)  # O_APPEND too: where the bytes went
                rec.log.append(Write(rec._fds[fd], end - count, _bytes(data, count)))
            return count

    def pwrite(fd: int, data: Any, offset: int) -> int:
        with rec._lock:
            count = call("pwrite", fd, data, offset)
            if fd in rec._fds:
                rec.log.append(Write(rec._fds[fd], offset, _bytes(data, count)))
            return count

    def ftruncate(fd: int, size: int) -> None:
        with rec._lock:
            call("ftruncate", fd, size)
            if fd in rec._fds:
                rec.log.append(Truncate(rec._fds[fd], size))

    def truncate(path: Any, size: int) -> None:
        with rec._lock:
            inode = _target(rec, path, None, placed)
            call("truncate", path, size)
            if inode is not None:
                rec.log.append(Truncate(inode, size))

    def fsync(fd: Any) -> None:
        number = fd if isinstance(fd, int) else fd.fileno()
        with rec._lock:
            call("fsync", fd)
            if number in rec._fds:
                rec.log.append(Sync(rec._fds[number]))

    def fdatasync(fd: Any) -> None:
        number = fd if isinstance(fd, int) else fd.fileno()
        with rec._lock:
            call("fdatasync", fd)
            if number in rec._fds:
                rec.log.append(Sync(rec._fds[number]))

    def fchmod(fd: int, mode: int) -> None:
        with rec._lock:
            call("fchmod", fd, mode)
            if fd in rec._fds:
                rec.log.append(Chmod(rec._fds[fd], stat.S_IMODE(os.fstat(fd).st_mode)))

    def chmod(path: Any, mode: int, *, dir_fd: int | None = None, follow_symlinks: bool = True):
        with rec._lock:
            inode = _target(rec, path, dir_fd, placed)
            call("chmod", path, mode, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
            if inode is not None:
                rec.log.append(Chmod(inode, rec._mode_of(path, dir_fd)))

    def mkdir(path: Any, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        with rec._lock:
            where = placed(f"mkdir {path}", lambda: rec.locate(path, dir_fd))
            call("mkdir", path, mode, dir_fd=dir_fd)
            if where is not None:
                made = AddName(*where, rec._new_inode(), "dir", rec._mode_of(path, dir_fd))
                rec._add(made)

    def move(name: str) -> Callable[..., None]:
        def rename(src: Any, dst: Any, *, src_dir_fd: int | None = None,
                   dst_dir_fd: int | None = None) -> None:  # fmt: skip
            with rec._lock:
                old = placed(f"{name} {src}", lambda: rec.locate(src, src_dir_fd))
                new = placed(f"{name} {dst}", lambda: rec.locate(dst, dst_dir_fd))
                call(name, src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
                if (old is None) != (new is None):
                    rec.errors.append(f"{name} {src} -> {dst} crosses the world's edge")
                elif old is not None and new is not None:
                    placed(f"{name} {src}", lambda: _renamed(rec, old, new))

        return rename

    def link(src: Any, dst: Any, *, src_dir_fd: int | None = None,
             dst_dir_fd: int | None = None, follow_symlinks: bool = True) -> None:  # fmt: skip
        with rec._lock:
            inode = _target(rec, src, src_dir_fd, placed)
            new = placed(f"link {dst}", lambda: rec.locate(dst, dst_dir_fd))
            call("link", src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd,
                         follow_symlinks=follow_symlinks)  # fmt: skip
            if inode is not None and new is not None:
                rec._add(AddName(*new, inode))

    def unlinker(name: str) -> Callable[..., None]:
        def unlink(path: Any, *, dir_fd: int | None = None) -> None:
            with rec._lock:
                where = placed(f"{name} {path}", lambda: rec.locate(path, dir_fd))
                call(name, path, dir_fd=dir_fd)
                if where is not None:
                    placed(f"{name} {path}", lambda: rec._remove(*where))

        return unlink

    def symlink(src: Any, dst: Any, target_is_directory: bool = False, *,
                dir_fd: int | None = None) -> None:  # fmt: skip
        with rec._lock:
            if rec._start(dst, dir_fd) is not None:
                rec.errors.append(f"symlink {dst}: links are not modelled")
            call("symlink", src, dst, target_is_directory, dir_fd=dir_fd)

    def fdopen(fd: int, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        with rec._lock:
            if fd in rec._fds and any(c in mode for c in "wax+"):
                rec.errors.append(f"fdopen({fd}, {mode!r}): writes through io are not modelled")
            rec._fds.pop(fd, None)  # io closes it without os.close
            return call("fdopen", fd, mode, *args, **kwargs)

    return {
        "open": open_, "close": close, "write": write, "pwrite": pwrite,
        "ftruncate": ftruncate, "truncate": truncate, "fsync": fsync,
        "fdatasync": fdatasync, "fchmod": fchmod, "chmod": chmod, "mkdir": mkdir,
        "rename": move("rename"), "replace": move("replace"), "link": link,
        "unlink": unlinker("unlink"), "remove": unlinker("remove"),
        "rmdir": unlinker("rmdir"), "symlink": symlink, "fdopen": fdopen,
    }  # fmt: skip


def _lookup(rec: Recorder, start: tuple[int, list[str]]) -> int | None:
    """The inode a path names, or None when its last component does not exist."""
    inode, parts = start
    if not parts:
        return inode
    directory = rec._walk(inode, parts[:-1], "/".join(parts))
    return rec._entries[directory].get(parts[-1])


def _target(rec: Recorder, path: Any, dir_fd: int | None, placed: Callable[..., Any]) -> Any:
    if isinstance(path, int):
        return rec._fds.get(path)
    return placed(f"{path}", lambda: rec.resolve(path, dir_fd))


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
