"""A read-only stream over one object, fetched in ranges with read-ahead.

:class:`RangedReader` streams an object as a plain ``io.RawIOBase``: it keeps a few
ranges in flight on the store's read threads, so the restore path, which verifies
each chunk as it arrives (``read_full``/``readinto``), hashes one range while the
next ones download. The backend's ``fetch(offset, length)`` pins the version that
was opened (S3 ``If-Match``, Azure an ETag condition), so an object replaced while
it is read fails the read instead of mixing two versions' bytes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from io import RawIOBase
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

MiB = 1024 * 1024
READ_RANGE = 8 * MiB  # bytes per ranged read: two 4 MiB digest chunks
READ_AHEAD = 4  # ranges in flight per open stream (memory: READ_AHEAD + 1 ranges)


class RangedReader(RawIOBase):
    """A read-only stream over one object version of ``size`` bytes, fetched by
    ``fetch(offset, length)`` on ``pool`` with parallel read-ahead."""

    def __init__(
        self,
        fetch: Callable[[int, int], bytes],
        size: int,
        pool: ThreadPoolExecutor,
        range_size: int = READ_RANGE,
        read_ahead: int = READ_AHEAD,
    ) -> None:
        super().__init__()
        self._fetch = fetch
        self._size = size
        self._pool = pool
        self._range_size = range_size
        self._read_ahead = read_ahead
        self._requested = 0  # where the next range to fetch starts
        self._pending: deque[Future[bytes]] = deque()
        self._block = memoryview(b"")
        self._used = 0  # bytes of the current block already handed out

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        if self.closed:
            raise ValueError("read from a closed object stream")
        out = memoryview(buffer).cast("B")
        if not len(out):
            return 0
        if self._used >= len(self._block) and not self._next_block():
            return 0
        count = min(len(out), len(self._block) - self._used)
        out[:count] = self._block[self._used : self._used + count]
        self._used += count
        return count

    def readall(self) -> bytes:
        pieces = [bytes(self._block[self._used :])]
        self._used = len(self._block)
        while self._next_block():
            pieces.append(bytes(self._block))
            self._used = len(self._block)
        return b"".join(pieces)

    def close(self) -> None:
        for future in self._pending:
            future.cancel()  # started ones finish and are dropped
        self._pending.clear()
        self._block = memoryview(b"")
        super().close()

    def _next_block(self) -> bool:
        """Make the next range the current block; False at the end of the object."""
        self._request_more()
        if not self._pending:
            return False
        self._block = memoryview(self._pending.popleft().result())
        self._used = 0
        self._request_more()
        return True

    def _request_more(self) -> None:
        while len(self._pending) < self._read_ahead and self._requested < self._size:
            start = self._requested
            length = min(self._range_size, self._size - start)
            self._pending.append(self._pool.submit(self._fetch, start, length))
            self._requested += length
