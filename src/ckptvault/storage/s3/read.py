"""Reading one object: ranged GETs, pinned to the version that was opened.

Opening HEADs the object for its size and ETag; every later GET carries
``If-Match: <that ETag>``, so an object replaced while it is read fails the read
(``OSError``) instead of mixing two versions' bytes — the S3 analogue of checking
with ``fstat`` what was opened. :class:`S3ObjectReader` streams the object with
read-ahead (:class:`~ckptvault.storage.objects.reader.RangedReader`).
"""

from __future__ import annotations

import errno
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ckptvault.storage.objects.reader import READ_AHEAD, READ_RANGE, RangedReader
from ckptvault.storage.s3.client import S3Client, S3Error, S3PreconditionFailed


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


class S3ObjectReader(RangedReader):
    """A read-only stream over one object version, with parallel read-ahead."""

    def __init__(
        self,
        client: S3Client,
        head: ObjectHead,
        pool: ThreadPoolExecutor,
        range_size: int = READ_RANGE,
        read_ahead: int = READ_AHEAD,
    ) -> None:
        fetch = functools.partial(read_range, client, head)
        super().__init__(fetch, head.size, pool, range_size, read_ahead)
