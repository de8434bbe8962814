"""A store in an S3 bucket (or any S3-compatible object store): ``s3://bucket/prefix``.

The key layout is in :mod:`ckptvault.storage.objects.layout`; writing in
:mod:`~ckptvault.storage.s3.upload`, publishing (manifest last, ``If-None-Match``)
in :mod:`~ckptvault.storage.s3.publish`, the writer lease in
:mod:`~ckptvault.storage.objects.lease`, reading in :mod:`~ckptvault.storage.s3.read`
cleanup in :mod:`~ckptvault.storage.s3.cleanup`, versions and Object Lock holds in
:mod:`~ckptvault.storage.s3.versions`. This module ties them into a
:class:`~ckptvault.storage.base.Store` that is also a
:class:`~ckptvault.storage.retained.RetainingStore`.

What S3 semantics this relies on: strong read-after-write consistency for PUT,
DELETE, HEAD and LIST of objects; a completed multipart upload appears atomically;
conditional writes (``If-None-Match: *`` on PutObject and CompleteMultipartUpload,
``If-Match`` on PutObject and GetObject) — probed once per store before saving;
Object Lock only when ``object_lock_days`` is set.

Whoever can write the bucket may plant objects anywhere under the prefix. Listing a
generation reports every object that is not exactly where ckptvault writes it as
unsafe (see :func:`~ckptvault.storage.objects.layout.classify_entries`); reads serve only
the one key a name maps to, pinned to the version that was opened; records and the
lease are read with a size bound and a bounded JSON parser; nothing outside the
prefix is ever listed, written or deleted.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Sequence
from typing import Any

from ckptvault.errors import UsageError
from ckptvault.format.layout import MANIFEST_NAME, GenerationName
from ckptvault.storage.base import EntryInfo, GenerationRef
from ckptvault.storage.objects.layout import (
    OWN_PREFIX,
    ObjectLayout,
    classify_entries,
    listings_by_generation,
)
from ckptvault.storage.objects.lease import ObjectWriterLease
from ckptvault.storage.objects.store import ObjectStoreBase
from ckptvault.storage.records import (
    encode_record,
)
from ckptvault.storage.retained import LockRule, RetainedCopy
from ckptvault.storage.s3.cleanup import delete_generation, remove_stale_attempts
from ckptvault.storage.s3.client import CHECKSUM, S3Client, S3NotFound
from ckptvault.storage.s3.lease_object import S3LeaseObject
from ckptvault.storage.s3.options import S3Options, parse_s3_url
from ckptvault.storage.s3.publish import (
    ConditionalManifestPut,
    ConditionalWritesUnsupported,
    ObjectRetention,
    S3StagingArea,
    probe_conditional_writes,
)
from ckptvault.storage.s3.read import S3ObjectReader, head_object, read_range
from ckptvault.storage.s3.replace import replace_manifest
from ckptvault.storage.s3.versions import BucketVersioning, object_hold, purge_key

logger = logging.getLogger("ckptvault")

# Keys one bulk listing (``list_entries_of``) reads per generation it lists before it
# lists each generation alone instead: what that costs, 17 prefixes of up to 1,000
# keys. Other keys under ``data/`` (planted, or another application's at a bucket's
# root) then cost at most about that, never their number.
BULK_LISTING_KEYS_PER_GENERATION = 17 * 1000


class _ListingOverBudget(Exception):
    """A bulk listing met more keys than listing each generation alone would read."""


class S3Store(ObjectStoreBase):
    """A checkpoint store under ``s3://bucket/prefix`` (see the module docstring)."""

    def __init__(self, url: str, options: S3Options | None = None) -> None:
        self.options = options or S3Options()
        super().__init__(self.options.max_concurrency, "ckptvault-s3")
        where = parse_s3_url(url)
        self.location = where.url
        self.layout = ObjectLayout(where.prefix)
        self.client = S3Client(where, self.options)
        self.publish_rule = ConditionalManifestPut()
        self.retention = ObjectRetention(self.client, self.options.object_lock_days)
        self.versioning = BucketVersioning(self.client)
        self.writer_lease = ObjectWriterLease(
            S3LeaseObject(self.client, self.layout.lock_key),
            self.location,
            self.options.lease_seconds,
        )
        # True once the probe passed; the refusal once it failed; None before.
        self._conditional_writes: ConditionalWritesUnsupported | bool | None = None

    def __repr__(self) -> str:
        return f"S3Store({self.location!r})"

    # -- shared machinery --------------------------------------------------------------

    def list_prefixes(self, prefixes: list[str]) -> dict[str, list[dict[str, Any]]]:
        """Every object under each prefix, the prefixes listed in parallel."""
        listed = self.read_pool.map(lambda p: list(self.client.list_objects(p)), prefixes)
        return dict(zip(prefixes, listed, strict=True))

    def require_conditional_writes(self) -> None:
        """Probe once per store that the backend honours ``If-None-Match``."""
        with self._mutex:
            if isinstance(self._conditional_writes, ConditionalWritesUnsupported):
                raise self._conditional_writes
            if self._conditional_writes is not True:
                try:
                    probe_conditional_writes(self.client, self.layout)
                except ConditionalWritesUnsupported as verdict:
                    self._conditional_writes = verdict  # about the backend: keep it
                    raise
                self._conditional_writes = True

    def check_bucket(self) -> None:
        """``UsageError`` when the bucket does not exist (a store needs one)."""
        try:
            self.client.call("head_bucket")
        except S3NotFound as exc:
            raise UsageError(
                f"no checkpoint store at {self.location}: bucket {self.client.bucket} does not "
                "exist (create it first, or check the endpoint and credentials)"
            ) from exc

    # -- reading -----------------------------------------------------------------------

    def list_generations(self) -> list[GenerationRef]:
        names = set()
        for item in self._list(self.layout.generations_prefix):
            name = self.layout.parse_manifest_key(str(item["Key"]))
            if name is not None:
                names.add(name)
        return [self.ref_for(name) for name in sorted(names, reverse=True)]

    def list_entries(self, ref: GenerationRef) -> dict[str, EntryInfo]:
        own = self.layout.generation_prefix(ref.name)
        data = self.layout.data_prefixes(ref.generation_id)
        listed = self.list_prefixes([own, *data.values()])
        places = {OWN_PREFIX: own, **data}
        listings = {
            place: [(str(o["Key"])[len(prefix) :], int(o["Size"])) for o in listed[prefix]]
            for place, prefix in places.items()
        }
        entries = classify_entries(ref.generation_id, listings)
        self.remember_entries(ref, entries)
        return entries

    def list_entries_of(
        self, refs: Sequence[GenerationRef]
    ) -> dict[GenerationName, dict[str, EntryInfo]]:
        """Every generation's entries from one paginated listing of ``generations/``
        and one of ``data/`` (in parallel), instead of 17 listings per generation:
        ``ls`` of 1,000 generations costs pages of 1,000 keys, not 17,000 requests.
        Each generation's objects are judged as :meth:`list_entries` judges them.
        Other keys are passed over as they are listed; past
        :data:`BULK_LISTING_KEYS_PER_GENERATION` keys a generation (planted by the
        million, or another application's under a bucket's root ``data/``) each
        generation is listed alone instead, so other keys never cost more than that."""
        if not refs:
            return {}
        own, data = self.layout.generations_prefix, self.layout.data_root
        budget = BULK_LISTING_KEYS_PER_GENERATION * len(refs)
        # Only keys below a listed generation's name or id are kept (a superset of what
        # listings_by_generation takes); every other key is counted and passed over.
        kept = {own: {ref.name.dirname for ref in refs}, data: {ref.generation_id for ref in refs}}
        position = {own: 0, data: 1}  # of the name or id among a key's components
        try:
            listed = self.read_pool.map(
                lambda p: self._listed(p, budget, kept[p], position[p]), [own, data]
            )
            generation_objects, data_objects = listed
        except _ListingOverBudget:
            logger.info("%s holds many other keys: listing each generation alone", self.location)
            return {ref.name: self.list_entries(ref) for ref in refs}
        listings = listings_by_generation(
            self.layout, [ref.name for ref in refs], generation_objects, data_objects
        )
        return {
            name: classify_entries(name.generation_id, places) for name, places in listings.items()
        }

    def _listed(
        self, prefix: str, budget: int, kept: set[str], position: int
    ) -> list[tuple[str, int]]:
        """``(key, size)`` of the objects under ``prefix`` whose ``position``-th key
        component (below ``prefix``) is in ``kept``, in key order;
        ``_ListingOverBudget`` once more than ``budget`` objects were listed."""
        found = []
        for count, item in enumerate(self.client.list_objects(prefix), 1):
            if count > budget:
                raise _ListingOverBudget(prefix)
            key = str(item["Key"])
            parts = key[len(prefix) :].split("/", position + 1)
            if len(parts) > position + 1 and parts[position] in kept:
                found.append((key, int(item["Size"])))
        return found

    def open_file(self, ref: GenerationRef, name: str) -> S3ObjectReader:
        key = self.served_key(ref, name)
        return S3ObjectReader(self.client, head_object(self.client, key), self.read_pool)

    def read_range(self, ref: GenerationRef, name: str, offset: int, length: int) -> bytes:
        key = self.served_key(ref, name)
        return read_range(self.client, head_object(self.client, key), offset, length)

    def read_bytes(self, ref: GenerationRef, name: str, limit: int) -> bytes:
        head = head_object(self.client, self.served_key(ref, name))
        if head.size > limit:  # refused before a byte is downloaded
            raise OSError(errno.EFBIG, f"{name} is larger than {limit} bytes")
        return read_range(self.client, head, 0, head.size)

    def _list(self, prefix: str) -> list[dict[str, Any]]:
        try:
            return list(self.client.list_objects(prefix))
        except S3NotFound as exc:
            if exc.code != "NoSuchBucket":
                raise
            raise UsageError(
                f"bucket {self.client.bucket} of {self.location} does not exist"
            ) from exc

    # -- writing -----------------------------------------------------------------------

    def acquire_writer(self) -> None:
        self.check_bucket()
        self.writer_lease.acquire()

    def release_writer(self) -> None:
        self.writer_lease.release()

    def begin_generation(self, generation_id: str) -> S3StagingArea:
        self.require_conditional_writes()  # refuse before uploading, not after
        self.retention.check_bucket()
        return S3StagingArea(self, generation_id)

    def join_generation(self, generation_id: str) -> S3StagingArea:
        """Another rank's attempt: this rank's objects go under their own spread
        prefixes of the same attempt; only the beginning rank publishes."""
        return S3StagingArea(self, generation_id, joined=True)

    # -- lifecycle ---------------------------------------------------------------------

    def remove_stale_staging(self, older_than: float | None = None) -> list[str]:
        return remove_stale_attempts(self, older_than)

    def replace_manifest(
        self, ref: GenerationRef, manifest: bytes, signature: bytes | None, *, replaces: bytes
    ) -> None:
        """Key rotation's one change to a published generation (see
        :mod:`ckptvault.storage.s3.replace`); needs the writer lease."""
        replace_manifest(self, ref, manifest, signature, replaces)

    # -- versions and Object Lock (RetainingStore) ---------------------------------------

    def delete_generation_reporting(self, ref: GenerationRef) -> list[RetainedCopy]:
        return delete_generation(self, ref)

    def retained_until(self, ref: GenerationRef) -> str | None:
        """Whether the manifest is under Object Lock retention or a legal hold now
        (publish locks a generation's objects together, manifest last)."""
        try:
            hold = object_hold(self.client, self.layout.generation_key(ref.name, MANIFEST_NAME))
        except S3NotFound:
            return None  # deleted meanwhile: nothing holds it
        return hold[0] if hold is not None else None

    def set_lock_rule(self, rule: LockRule | None) -> None:
        self.retention.rule = rule

    def lock_policy(self) -> ObjectRetention:
        return self.retention

    # -- records -----------------------------------------------------------------------

    def listed_keys(self, prefix: str) -> list[tuple[str, int]]:
        return [(str(item["Key"]), int(item["Size"])) for item in self._list(prefix)]

    def read_head(self, key: str, limit: int) -> bytes:
        raw, _ = self.client.get_bytes(key, Range=f"bytes=0-{limit}")
        return raw

    def url_of(self, key: str) -> str:
        return self.client.url(key)

    def put_record(self, kind: str, name: str, data: dict[str, Any]) -> None:
        key = self.layout.record_key(kind, name)
        self.client.call("put_object", key, Body=encode_record(data), ChecksumAlgorithm=CHECKSUM)

    def delete_record(self, kind: str, name: str) -> None:
        key = self.layout.record_key(kind, name)
        self.client.call("delete_object", key)
        if self.versioning.enabled():
            purge_key(self.client, key)  # no noncurrent versions of marks and leases pile up
