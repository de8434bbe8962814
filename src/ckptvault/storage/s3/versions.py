"""Versioned buckets and Object Lock: every copy of a generation, and what holds it.

In a bucket with versioning a DELETE without a version id only puts a *delete
marker* on top: the object disappears from listings, but every earlier version
stays, stored and billed — a copy of the generation all the same. And Object Lock
(which needs versioning) forbids deleting a version before its retain-until date,
or at all while it is under a legal hold.

:func:`purge_versions` deletes every version of every object under a deleted
generation's prefixes (``DeleteObjects`` with ``VersionId``), then lists them again:
what is still there is reported as a :class:`~ckptvault.storage.retained.RetainedCopy`
with the reason (``locked until <date>``, ``under legal hold``, or the refusal),
never as a failure. A key that keeps a version keeps one delete marker on top, so a
retained manifest never becomes current again (the generation stays deleted); the
markers of keys with nothing left are deleted too.

:func:`object_hold` reads a version's retention with HEAD
(``ObjectLockRetainUntilDate``, ``ObjectLockLegalHoldStatus``), which every
S3-compatible store that supports Object Lock answers (GetObjectRetention is not
implemented everywhere).
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Protocol

from ckptvault.storage.retained import RetainedCopy, locked_until
from ckptvault.storage.s3.client import S3Client, S3Error, S3NotFound


class _Reads(Protocol):
    """What purging versions needs of an S3 store (:class:`~ckptvault.storage.s3.store.S3Store`)."""

    @property
    def client(self) -> S3Client: ...

    @property
    def read_pool(self) -> ThreadPoolExecutor: ...


logger = logging.getLogger("ckptvault")

_UNSUPPORTED = {"NotImplemented", "501", "MethodNotAllowed", "405"}
UNVERSIONED_RECHECK_SECONDS = 600.0  # versioning may be switched on under a running trainer
LEGAL_HOLD = "under legal hold"


class BucketVersioning:
    """Whether the bucket has (or had: "Suspended") versioning, asked once; "never
    versioned" is asked again every few minutes, since it can be switched on."""

    def __init__(self, client: S3Client) -> None:
        self.client = client
        self._mutex = threading.Lock()
        self._versioned: bool | None = None
        self._asked_at = 0.0

    def enabled(self) -> bool:
        with self._mutex:
            recheck = time.monotonic() - self._asked_at > UNVERSIONED_RECHECK_SECONDS
            if self._versioned is True or (self._versioned is False and not recheck):
                return self._versioned
        try:
            status = self.client.call("get_bucket_versioning").get("Status")
        except S3Error as exc:
            if exc.errno == errno.EACCES:
                logger.warning(
                    "cannot ask whether bucket %s keeps versions (%s): deleting without "
                    "deleting old versions; grant s3:GetBucketVersioning",
                    self.client.bucket,
                    exc,
                )
            elif exc.code not in _UNSUPPORTED:
                raise
            status = None  # a backend without versioning, or one that will not say
        versioned = status in ("Enabled", "Suspended")  # suspended: old versions remain
        with self._mutex:
            self._versioned, self._asked_at = versioned, time.monotonic()
        return versioned


def object_hold(
    client: S3Client, key: str, version_id: str | None = None, now: datetime | None = None
) -> tuple[str, datetime | None] | None:
    """Why ``key`` (that version) may not be deleted now: ``("locked until <date>",
    date)`` or ``("under legal hold", date or None)``; None when nothing holds it."""
    params = {"VersionId": version_id} if version_id else {}
    head = client.call("head_object", key, **params)
    until = head.get("ObjectLockRetainUntilDate")
    until = until if isinstance(until, datetime) else None
    if head.get("ObjectLockLegalHoldStatus") == "ON":
        return LEGAL_HOLD, until
    if until is not None and until > (now or datetime.now(timezone.utc)):
        return locked_until(until), until
    return None


def purge_versions(store: _Reads, prefixes: list[str]) -> list[RetainedCopy]:
    """Delete every version and delete marker under ``prefixes`` (a deleted
    generation's own prefixes); returns the versions that had to stay."""
    client = store.client
    listed = _versions(store, prefixes)
    refused = client.delete_versions(
        [(key, version) for key, version, marker, _latest in listed if not marker]
    )
    left = _versions(store, prefixes)
    held = {key for key, _version, marker, _latest in left if not marker}
    stale_markers = [
        (key, version)
        for key, version, marker, latest in left
        if marker and (key not in held or not latest)  # one marker stays over what stays
    ]
    client.delete_versions(stale_markers)
    for key in sorted({key for key, _v, marker, latest in left if not marker and latest}):
        client.call("delete_object", key)  # a retained version is never the current one
    retained = []
    for key, version, marker, _latest in left:
        if not marker:
            retained.append(_retained_copy(client, key, version, refused.get(key)))
    return retained


def purge_key(client: S3Client, key: str) -> None:
    """Delete every version of one small object (a record) after its deletion; when
    one may not go, its delete markers stay, so the record stays deleted."""
    try:
        listed = [v for v in client.list_versions(key) if v.get("Key") == key]
        refused = client.delete_versions(
            [(key, str(v["VersionId"])) for v in listed if not v.get("DeleteMarker")]
        )
        if not refused:
            markers = [(key, str(v["VersionId"])) for v in listed if v.get("DeleteMarker")]
            client.delete_versions(markers)
    except S3Error as exc:  # the record is deleted either way; its old versions are not ours
        logger.debug("earlier versions of %s stay: %s", client.url(key), exc)


def _versions(store: _Reads, prefixes: list[str]) -> list[tuple[str, str, bool, bool]]:
    """``(key, version id, is a delete marker, is latest)`` under every prefix."""
    listed = store.read_pool.map(lambda p: list(store.client.list_versions(p)), prefixes)
    return [
        (str(v["Key"]), str(v["VersionId"]), bool(v.get("DeleteMarker")), bool(v.get("IsLatest")))
        for versions in listed
        for v in versions
    ]


def _retained_copy(
    client: S3Client, key: str, version_id: str, refusal: str | None
) -> RetainedCopy:
    try:
        hold = object_hold(client, key, version_id)
    except S3NotFound:
        hold = None  # gone meanwhile
    except S3Error as exc:
        logger.debug("cannot read the retention of %s (%s): %s", client.url(key), version_id, exc)
        hold = None
    if hold is not None:
        return RetainedCopy(client.url(key), version_id, hold[0], hold[1])
    return RetainedCopy(client.url(key), version_id, refusal or "the store refused to delete it")
