"""Read a small control file that someone else may have planted something at.

A record another process writes beside us (a job's progress file, its DONE record) is
read by a process that must not be steered by what lies at that path: a FIFO would
block its ``open`` for ever, a symlink would have it read a file of the planter's
choosing, a directory would leak a descriptor per attempt. :func:`read_plain_file`
opens with ``O_NOFOLLOW | O_NONBLOCK``, checks the descriptor with ``fstat`` and
reads only a plain file, closing the descriptor whatever happens.
"""

from __future__ import annotations

import errno
import os
import stat

from ckptvault.errors import UnsafeEntryError


def read_plain_file(path: str | os.PathLike[str], limit: int, what: str, hint: str) -> bytes:
    """At most ``limit`` bytes of the plain file at ``path``.

    :class:`UnsafeEntryError` when ``path`` is a symlink or anything but a plain file
    (its message: ``what``, what was found, then ``hint``: what to do); ``OSError``
    (``FileNotFoundError`` ...) when it cannot be opened."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeEntryError(f"{what} is a symlink, not followed; {hint}") from None
        raise
    # The descriptor itself, closed whatever happens: os.fdopen of a directory raises
    # (naming the descriptor's number, not the path) and leaves it open.
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafeEntryError(
                f"{what} is not a plain file (a FIFO, device or directory), not read; {hint}"
            )
        os.set_blocking(fd, True)
        return os.read(fd, limit)
    finally:
        os.close(fd)
