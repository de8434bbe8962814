"""Removing what S3 saves leave behind, and deleting published generations.

An attempt that never published (a crash, a kill, a lost network) leaves objects
under its ``data/<x>/<generation id>/`` prefixes and possibly incomplete multipart
uploads, which S3 keeps (and bills) until they are aborted. No lock can prove such
an attempt dead — its writer may be paused, or on another machine — so only age
can: :func:`remove_stale_attempts` removes an attempt only when nothing of it
(object, part, or the attempt's own start) is newer than ``older_than`` seconds,
judged by the server's clock. A huge upload that is still making progress has a
fresh part, so it is never aborted, nor are its sibling files deleted.

:func:`delete_generation` deletes the manifest first, so the generation stops
existing before any of its bytes go, then the signature, then its objects in
batches of at most 1,000, and in a versioned bucket every version of them
(:mod:`~ckptvault.storage.s3.versions`).
"""

from __future__ import annotations

import email.utils
import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Protocol

from ckptvault.errors import UsageError
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME, generation_id_time
from ckptvault.storage.base import GenerationRef
from ckptvault.storage.objects.layout import ObjectLayout
from ckptvault.storage.retained import RetainedCopy
from ckptvault.storage.s3.client import S3Client, S3Error, S3NotFound
from ckptvault.storage.s3.versions import BucketVersioning, purge_versions


class _Cleaned(Protocol):
    """What removing attempts and generations needs of an S3 store
    (:class:`~ckptvault.storage.s3.store.S3Store`, which imports this module)."""

    @property
    def client(self) -> S3Client: ...

    @property
    def layout(self) -> ObjectLayout: ...

    @property
    def versioning(self) -> BucketVersioning: ...

    @property
    def read_pool(self) -> ThreadPoolExecutor: ...

    def list_generations(self) -> list[GenerationRef]: ...

    def list_prefixes(self, prefixes: list[str]) -> dict[str, list[dict[str, Any]]]: ...

    def forget_entries(self, ref: GenerationRef) -> None: ...


logger = logging.getLogger("ckptvault")


@dataclass
class _Attempt:
    """What one unpublished save attempt left: its objects, its uploads, its last write."""

    newest: float
    keys: list[str] = field(default_factory=list)
    uploads: list[tuple[str, str]] = field(default_factory=list)  # (key, upload id)


def server_now(client: S3Client) -> float:
    """The server's clock (a response's ``Date``), so that ages compare server times
    with server times; this machine's clock if the server sends none.

    ``Date`` is truncated to the second, so the end of that second is taken: with
    ``older_than=0`` everything up to now counts as old, and for any real age a
    second more or less does not matter."""
    response = client.call("head_bucket")
    headers = (response.get("ResponseMetadata") or {}).get("HTTPHeaders") or {}
    try:
        return email.utils.parsedate_to_datetime(headers["date"]).timestamp() + 1.0
    except (KeyError, TypeError, ValueError):
        return datetime.now(timezone.utc).timestamp()


def remove_stale_attempts(store: _Cleaned, older_than: float | None) -> list[str]:
    """Abort and delete what unpublished attempts left, when older than ``older_than``
    seconds; returns the generation ids removed (and keys of stray uploads)."""
    if older_than is None:
        return []  # nothing is provably dead without an age (see the module docstring)
    if older_than < 0:
        raise UsageError(f"older_than={older_than}: give a number of seconds >= 0")
    cutoff = server_now(store.client) - older_than
    attempts, strays = _survey(store)
    removed = []
    for key, upload_id, newest in strays:
        if newest <= cutoff and _abort_upload(store.client, key, upload_id):
            removed.append(key)
    stale = {gid for gid, attempt in attempts.items() if attempt.newest <= cutoff}
    # Look again right before deleting: an attempt that published meanwhile is kept.
    stale -= {ref.generation_id for ref in store.list_generations()}
    for generation_id in sorted(stale):
        attempt = attempts[generation_id]
        if _written_since(store.client, attempt.keys, cutoff):
            continue  # a listing can lag; an object's own HEAD says it is still fresh
        aborted = all([_abort_upload(store.client, k, u) for k, u in attempt.uploads])
        store.client.delete_keys(attempt.keys)
        if aborted:
            removed.append(generation_id)
    return removed


def _survey(store: _Cleaned) -> tuple[dict[str, _Attempt], list[tuple[str, str, float]]]:
    """Unpublished attempts by generation id, and uploads that belong to none
    (``(key, upload id, last write)``): a published attempt's leftovers.

    Only keys this store makes count (``ObjectLayout.parse_data_key``): ckptvault
    uploads nothing elsewhere, and a store at a bucket's root must not abort another
    application's uploads under ``data/``, nor delete its objects."""
    published = {ref.generation_id for ref in store.list_generations()}
    attempts: dict[str, _Attempt] = defaultdict(lambda: _Attempt(newest=0.0))
    strays = []
    for upload in store.client.list_uploads(store.layout.data_root):
        key, upload_id = str(upload["Key"]), str(upload["UploadId"])
        parsed = store.layout.parse_data_key(key)
        if parsed is None:
            continue  # not a key ckptvault makes: someone else's upload
        newest = _upload_activity(store.client, key, upload_id, upload.get("Initiated"))
        if parsed[1] in published:
            strays.append((key, upload_id, newest))
            continue
        attempt = attempts[parsed[1]]
        attempt.uploads.append((key, upload_id))
        attempt.newest = max(attempt.newest, newest)
    for item in store.client.list_objects(store.layout.data_root):
        parsed = store.layout.parse_data_key(str(item["Key"]))
        if parsed is None or parsed[1] in published:
            continue  # a published generation's data, or nothing ckptvault wrote
        attempt = attempts[parsed[1]]
        attempt.keys.append(str(item["Key"]))
        attempt.newest = max(attempt.newest, _timestamp(item.get("LastModified")))
    for generation_id, attempt in attempts.items():
        # The attempt began when its id was made: never older than that.
        attempt.newest = max(attempt.newest, generation_id_time(generation_id).timestamp())
    return dict(attempts), strays


def _written_since(client: S3Client, keys: list[str], cutoff: float) -> bool:
    """Whether any of ``keys`` was written after ``cutoff``, by each object's HEAD."""
    for key in keys:
        try:
            response = client.call("head_object", key)
        except S3NotFound:
            continue  # gone meanwhile
        if _timestamp(response.get("LastModified")) > cutoff:
            return True
    return False


def _upload_activity(client: S3Client, key: str, upload_id: str, initiated: Any) -> float:
    """When an upload last made progress: its newest part, or its start without parts."""
    newest = _timestamp(initiated)
    try:
        for part in client.list_parts(key, upload_id):
            newest = max(newest, _timestamp(part.get("LastModified")))
    except S3NotFound:
        pass  # completed or aborted meanwhile
    return newest


def _abort_upload(client: S3Client, key: str, upload_id: str) -> bool:
    try:
        client.call("abort_multipart_upload", key, UploadId=upload_id)
    except S3NotFound:
        pass
    except S3Error as exc:
        logger.warning("could not abort the stale upload to %s: %s", client.url(key), exc)
        return False
    return True


def _timestamp(value: Any) -> float:
    return value.timestamp() if isinstance(value, datetime) else 0.0


def delete_generation(store: _Cleaned, ref: GenerationRef) -> list[RetainedCopy]:
    """Manifest first (the generation is gone), then signature, then its objects;
    in a versioned bucket then every version of them (:func:`purge_versions`).
    Returns the versions that had to stay (Object Lock). Idempotent. Data shared with
    another manifest of the same generation id (only a planted copy can do that) is
    left in place."""
    layout, client = store.layout, store.client
    client.call("delete_object", layout.generation_key(ref.name, MANIFEST_NAME))
    client.call("delete_object", layout.generation_key(ref.name, SIGNATURE_NAME))
    store.forget_entries(ref)
    prefixes = [layout.generation_prefix(ref.name)]
    if not any(other.generation_id == ref.generation_id for other in store.list_generations()):
        prefixes += list(layout.data_prefixes(ref.generation_id).values())
    listed = store.list_prefixes(prefixes)
    client.delete_keys([str(item["Key"]) for items in listed.values() for item in items])
    return purge_versions(store, prefixes) if store.versioning.enabled() else []
