"""Reading one object: ranged GETs, pinned to the version that was opened.

Opening HEADs the object for its size and ETag; every later GET carries
``If-Match: <that ETag>``, so an object replaced while it is read fails the read
(``OSError``) instead of mixing two versions' bytes — the S3 analogue of checking
with ``fstat`` what was opened. :class:`S3ObjectReader` streams the object as a
plain ``io.RawIOBase``: it keeps a few ranges in flight on the store's read threads
(read-ahead), so the restore path, which verifies each chunk as it arrives
(``read_full``/``readinto``), hashes one range while the next ones download.
"""

from __future__ import annotations

import errno
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from io import RawIOBase
from typing import TYPE_CHECKING

from ckptvault.storage.s3.client import S3Client, S3Error, S3PreconditionFailed

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

MiB = 1024 * 1024
READ_RANGE = 8 * MiB  # bytes per ranged GET: two 4 MiB digest chunks
READ_AHEAD = 4  # ranges in flight per open stream (memory: READ_AHEAD + 1 ranges)


@dataclass(frozen=True)
class ObjectHead:
    """What opening an object found: its size and the version (ETag) to read."""

    key: str
    size: int
    etag: str


def head_object(client: S3Client, key: str) -> ObjectHead:
    """HEAD ``key``; :class:`~ckptvault.storage.s3.client.S3NotFound` when it is missing."""
    response = client.call("head_object", key)
    return ObjectHead(key, int(response["ContentLength"]), str(response["ETag"]))


def read_range(client: S3Client, head: ObjectHead, offset: int, length: int) -> bytes:
    """Up to ``length`` bytes from ``offset`` of the opened version (fewer at the end)."""
    end = min(offset + length, head.size)
    if offset >= end:
        return b""
    try:
        data, _ = client.get_bytes(head.key, Range=f"bytes={offset}-{end - 1}", IfMatch=head.etag)
    except S3PreconditionFailed as exc:
        raise S3Error(
            errno.EIO,
            f"{client.url(head.key)} was replaced while it was being read; read it again",
            "Changed",
        ) from exc
    if len(data) != end - offset:
        raise S3Error(
            errno.EIO,
            f"{client.url(head.key)}: asked for bytes {offset}-{end - 1}, got {len(data)} bytes",
            "ShortRead",
        )
    return data


class S3ObjectReader(RawIOBase):
    """A read-only stream over one object version, with parallel read-ahead."""

    def __init__(
        self,
        client: S3Client,
        head: ObjectHead,
        pool: ThreadPoolExecutor,
        range_size: int = READ_RANGE,
        read_ahead: int = READ_AHEAD,
    ) -> None:
        super().__init__()
        self._client = client
        self._head = head
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
            raise ValueError("read from a closed S3 object stream")
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
        while len(self._pending) < self._read_ahead and self._requested < self._head.size:
            start = self._requested
            length = min(self._range_size, self._head.size - start)
            self._pending.append(
                self._pool.submit(read_range, self._client, self._head, start, length)
            )
            self._requested += length
