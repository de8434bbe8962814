"""The S3 store's writer lease object: :class:`~ckptvault.storage.objects.lease.LeaseObject`
over conditional ``PutObject`` (``If-None-Match: *``, ``If-Match: <ETag>``) and a
ranged ``GetObject``. The lease protocol itself is
:class:`~ckptvault.storage.objects.lease.ObjectWriterLease`."""

from __future__ import annotations

import email.utils
from datetime import datetime, timezone
from typing import Any

from ckptvault.storage.objects.lease import LeaseSnapshot
from ckptvault.storage.s3.client import S3Client, S3Error, S3NotFound


class S3LeaseObject:
    """The lease at ``key`` of ``client``'s bucket."""

    def __init__(self, client: S3Client, key: str) -> None:
        self.client = client
        self.key = key
        self.url = client.url(key)

    def create(self, data: bytes) -> str:
        response = self.client.call("put_object", self.key, Body=data, IfNoneMatch="*")
        return str(response["ETag"])

    def replace(self, data: bytes, etag: str) -> str:
        response = self.client.call("put_object", self.key, Body=data, IfMatch=etag)
        return str(response["ETag"])

    def read(self, limit: int) -> LeaseSnapshot | None:
        try:
            raw, response = self.client.get_bytes(self.key, Range=f"bytes=0-{limit - 1}")
        except S3NotFound:
            return None
        except S3Error as exc:
            if exc.code != "InvalidRange":  # an empty object has no byte 0
                raise
            raw, response = b"", self.client.call("head_object", self.key)
        total = str(response.get("ContentRange") or "").rpartition("/")[2]
        size = int(total) if total.isdigit() else len(raw)
        return LeaseSnapshot(raw, size, str(response["ETag"]), server_age(response))


def server_age(response: dict[str, Any]) -> float:
    """Seconds since the object was last written, by the server's clock (the
    response's ``Date`` minus the object's ``LastModified``)."""
    headers = (response.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
    try:
        now = email.utils.parsedate_to_datetime(headers["date"])
    except (KeyError, TypeError, ValueError):
        now = datetime.now(timezone.utc)
    modified = response.get("LastModified")
    if not isinstance(modified, datetime):
        return 0.0
    return (now - modified).total_seconds()
