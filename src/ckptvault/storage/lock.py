"""An advisory single-writer lock that a killed process cannot leave stuck.

``flock(2)`` locks belong to an open file description: the kernel drops them when
the holder exits for any reason, SIGKILL included, so there is no stale-lock
recovery to get wrong. The holder's pid, host and start time are written into the
lock file only to make the error message useful.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import weakref
from collections.abc import Callable
from datetime import datetime, timezone

from ckptvault.errors import FormatError, StoreLockedError
from ckptvault.format.bounded_json import loads_bounded
from ckptvault.format.layout import WRITER_LOCK


class WriterLock:
    """The lock of one store; ``open_lock_file`` opens (creating) the lock file safely
    and returns its descriptor."""

    def __init__(self, open_lock_file: Callable[[], int], store_location: str) -> None:
        self._open_lock_file = open_lock_file
        self.store_location = store_location
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        fd = self._open_lock_file()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise StoreLockedError(
                f"store {self.store_location} is being written by another live process "
                f"({holder}); ckptvault allows one writer per store. Stop that process, or "
                "save this run into a different directory."
            ) from None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": datetime.now(timezone.utc).isoformat(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd = fd
        # A manager dropped without close() must not keep the store locked.
        self._finalizer = weakref.finalize(self, os.close, fd)

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        self._finalizer.detach()
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)


def _read_holder(fd: int) -> str:
    try:
        info = loads_bounded(os.pread(fd, 4096, 0) or b"{}", WRITER_LOCK, max_depth=4)
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"[:300]
    except (OSError, FormatError, KeyError, TypeError):  # the store's bytes: anyone's
        return "holder unknown"
