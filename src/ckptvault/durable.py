"""Durable writes on a local filesystem, in the one order that survives a crash.

A file is durable once its bytes are fsync'd *and* the directory entry naming it is
fsync'd. An atomic replacement writes the new bytes under a private temporary name
in the same directory, fsyncs them, renames (or links) the temporary over the final
name, and fsyncs the directory: a crash at any point leaves the old file or the new
one, never a mix. Control-plane files (key store, export outputs) use these helpers;
the POSIX store follows the same order for whole generations.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path


def fsync_directory(path: str | os.PathLike[str]) -> None:
    """Make the entries of ``path`` (creations, renames, unlinks) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs_durable(path: Path, mode: int = 0o777) -> None:
    """``mkdir -p`` whose new entries survive a crash: fsync each new directory's parent.
    ``path`` itself is made with ``mode`` (the umask applies), its parents as
    ``Path.mkdir(parents=True)`` makes them."""
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode if directory == path else 0o777)
        except FileExistsError:
            continue
        fsync_directory(directory.parent)


@contextlib.contextmanager
def atomic_path(final: Path, *, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; on a clean exit make it durable and
    move it into place (``replace=False``: only if ``final`` does not exist yet,
    raising ``FileExistsError`` otherwise). On an error nothing changes at ``final``.

    The caller writes the temporary path with whatever library it likes (safetensors
    ``save_file``, say); this helper owns the fsync and rename order.
    """
    temporary = final.with_name(f".{final.name}.{secrets.token_hex(6)}.tmp")
    try:
        yield temporary
        fd = os.open(temporary, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(temporary, final)
        else:
            os.link(temporary, final)  # fails if final exists: concurrent creators agree
        fsync_directory(final.parent)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)


def write_atomically(path: Path, data: bytes, *, mode: int = 0o644, replace: bool = True) -> None:
    """Write ``data`` as the whole new content of ``path``, durably and atomically."""
    with atomic_path(path, replace=replace) as temporary:
        fd = os.open(
            temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode
        )
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
