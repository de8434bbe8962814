"""A store in an Azure Blob Storage container: ``az://container/prefix``.

The blob names are the ones every object store uses
(:mod:`ckptvault.storage.objects.layout`); the writer lease is the shared
conditional-write lease (:mod:`ckptvault.storage.objects.lease`) over a lease blob
(:class:`AzureLeaseBlob`). Writing is in :mod:`~ckptvault.storage.azure.upload`
(staged blocks, one commit), publishing (manifest last, ``If-None-Match: *``) in
:mod:`~ckptvault.storage.azure.publish`, cleanup in
:mod:`~ckptvault.storage.azure.cleanup`, versions and immutability policies in
:mod:`~ckptvault.storage.azure.versions`. This module ties them into a
:class:`~ckptvault.storage.base.Store` that is also a
:class:`~ckptvault.storage.retained.RetainingStore`.

Whoever can write the container may plant blobs anywhere under the prefix. Listing a
generation reports every blob not exactly where ckptvault writes it as unsafe
(:func:`~ckptvault.storage.objects.layout.classify_entries`); reads serve only the
one blob a name maps to, pinned to the ETag that was opened; records and the lease
are read with a size bound and a bounded JSON parser; staged (uncommitted) blocks are
never listed as entries; nothing outside the prefix is listed, written or deleted.
"""

from __future__ import annotations

import errno
import functools
import logging
from collections.abc import Sequence
from typing import Any

from ckptvault.errors import UsageError
from ckptvault.format.layout import MANIFEST_NAME, GenerationName
from ckptvault.storage.azure.cleanup import delete_generation, remove_stale_attempts
from ckptvault.storage.azure.client import AzureClient, AzureError, AzureNotFound, Listed
from ckptvault.storage.azure.options import AzureOptions, parse_az_url
from ckptvault.storage.azure.publish import AzureStagingArea
from ckptvault.storage.azure.versions import Immutability, blob_hold, purge_key
from ckptvault.storage.base import EntryInfo, GenerationRef
from ckptvault.storage.objects.layout import (
    OWN_PREFIX,
    ListingOverBudget,
    ObjectLayout,
    classify_entries,
    keys_of_generations,
    listings_by_generation,
)
from ckptvault.storage.objects.lease import LeaseSnapshot, ObjectWriterLease
from ckptvault.storage.objects.reader import RangedReader
from ckptvault.storage.objects.store import ObjectStoreBase
from ckptvault.storage.records import (
    encode_record,
)
from ckptvault.storage.retained import LockRule, RetainedCopy

logger = logging.getLogger("ckptvault")

# Blobs one bulk listing (``list_entries_of``) reads per generation it lists before it
# lists each generation alone instead: what that costs, 17 prefixes of one page
# (5,000 blobs) each.
BULK_LISTING_KEYS_PER_GENERATION = 17 * 5000


class AzureLeaseBlob:
    """The writer lease's blob: :class:`~ckptvault.storage.objects.lease.LeaseObject`
    over conditional Put Blob (``If-None-Match: *``, ``If-Match: <ETag>``)."""

    def __init__(self, client: AzureClient, key: str) -> None:
        self.client = client
        self.key = key
        self.url = client.url(key)

    def create(self, data: bytes) -> str:
        return self.client.put_new(self.key, data)

    def replace(self, data: bytes, etag: str) -> str:
        return self.client.put_if_match(self.key, data, etag)

    def read(self, limit: int) -> LeaseSnapshot | None:
        try:
            raw, size, etag, age = self.client.get_with_age(self.key, limit)
        except AzureNotFound:
            return None
        except AzureError as exc:
            if exc.code != "InvalidRange":  # an empty blob has no byte 0
                raise
            head = self.client.head(self.key)
            raw, size, etag, age = b"", head.size, head.etag, 0.0
        return LeaseSnapshot(raw, size, etag, age)


class AzureStore(ObjectStoreBase):
    """A checkpoint store under ``az://container/prefix`` (see the module docstring)."""

    def __init__(self, url: str, options: AzureOptions | None = None) -> None:
        self.options = options or AzureOptions()
        super().__init__(self.options.max_concurrency, "ckptvault-az")
        where = parse_az_url(url)
        self.location = where.url
        self.layout = ObjectLayout(where.prefix)
        self.client = AzureClient(where, self.options)
        self.immutability = Immutability(self.client, self.options.immutability_days)
        self.writer_lease = ObjectWriterLease(
            AzureLeaseBlob(self.client, self.layout.lock_key),
            self.location,
            self.options.lease_seconds,
        )

    def __repr__(self) -> str:
        return f"AzureStore({self.location!r})"

    # -- shared machinery --------------------------------------------------------------

    def list_prefixes(self, prefixes: list[str]) -> dict[str, list[Listed]]:
        """Every committed blob under each prefix, the prefixes listed in parallel."""
        listed = self.read_pool.map(lambda p: list(self.client.list_blobs(p)), prefixes)
        return dict(zip(prefixes, listed, strict=True))

    def check_container(self) -> None:
        """``UsageError`` when the container does not exist (a store needs one)."""
        if not self.client.container_exists():
            raise UsageError(
                f"no checkpoint store at {self.location}: container {self.client.container} "
                "does not exist (create it first, or check the account and credentials)"
            )

    # -- reading -----------------------------------------------------------------------

    def list_generations(self) -> list[GenerationRef]:
        names = set()
        for item in self._list(self.layout.generations_prefix):
            name = self.layout.parse_manifest_key(item.key)
            if name is not None:
                names.add(name)
        return [self.ref_for(name) for name in sorted(names, reverse=True)]

    def list_entries(self, ref: GenerationRef) -> dict[str, EntryInfo]:
        own = self.layout.generation_prefix(ref.name)
        data = self.layout.data_prefixes(ref.generation_id)
        listed = self.list_prefixes([own, *data.values()])
        places = {OWN_PREFIX: own, **data}
        listings = {
            place: [(item.key[len(prefix) :], item.size) for item in listed[prefix]]
            for place, prefix in places.items()
        }
        entries = classify_entries(ref.generation_id, listings)
        self.remember_entries(ref, entries)
        return entries

    def list_entries_of(
        self, refs: Sequence[GenerationRef]
    ) -> dict[GenerationName, dict[str, EntryInfo]]:
        """Every generation's entries from one paged listing of ``generations/`` and
        one of ``data/`` (in parallel), judged as :meth:`list_entries` judges them.
        Past :data:`BULK_LISTING_KEYS_PER_GENERATION` blobs a generation (others
        planted by the million, or another application's under a container's root
        ``data/``), each generation is listed alone instead: other blobs never cost
        more than that (as on S3)."""
        if not refs:
            return {}
        own, data = self.layout.generations_prefix, self.layout.data_root
        budget = BULK_LISTING_KEYS_PER_GENERATION * len(refs)
        kept = {own: {ref.name.dirname for ref in refs}, data: {ref.generation_id for ref in refs}}
        position = {own: 0, data: 1}  # of the name or id among a key's components

        def listed(prefix: str) -> list[tuple[str, int]]:
            blobs = ((item.key, item.size) for item in self.client.list_blobs(prefix))
            return keys_of_generations(blobs, prefix, budget, kept[prefix], position[prefix])

        try:
            generation_objects, data_objects = self.read_pool.map(listed, [own, data])
        except ListingOverBudget:
            logger.info("%s holds many other blobs: listing each generation alone", self.location)
            return {ref.name: self.list_entries(ref) for ref in refs}
        listings = listings_by_generation(
            self.layout, [ref.name for ref in refs], generation_objects, data_objects
        )
        return {
            name: classify_entries(name.generation_id, places) for name, places in listings.items()
        }

    def open_file(self, ref: GenerationRef, name: str) -> RangedReader:
        key = self.served_key(ref, name)
        head = self.client.head(key)
        fetch = functools.partial(self._read_pinned, key, head.etag, head.size)
        return RangedReader(fetch, head.size, self.read_pool)

    def read_range(self, ref: GenerationRef, name: str, offset: int, length: int) -> bytes:
        key = self.served_key(ref, name)
        head = self.client.head(key)
        return self._read_pinned(key, head.etag, head.size, offset, length)

    def read_bytes(self, ref: GenerationRef, name: str, limit: int) -> bytes:
        key = self.served_key(ref, name)
        head = self.client.head(key)
        if head.size > limit:  # refused before a byte is downloaded
            raise OSError(errno.EFBIG, f"{name} is larger than {limit} bytes")
        return self._read_pinned(key, head.etag, head.size, 0, head.size)

    def _read_pinned(self, key: str, etag: str, size: int, offset: int, length: int) -> bytes:
        """Bytes of the version opened (``etag``); an error once the blob changed."""
        end = min(offset + length, size)
        if offset >= end:
            return b""
        try:
            data = self.client.get_range(key, offset, end - offset, etag)
        except AzureError as exc:
            if exc.errno == errno.EEXIST:  # the ETag condition failed
                raise AzureError(
                    errno.EIO,
                    f"{self.client.url(key)} was replaced while it was being read; read it again",
                    "Changed",
                ) from exc
            raise
        if len(data) != end - offset:
            raise AzureError(
                errno.EIO,
                f"{self.client.url(key)}: asked for bytes {offset}-{end - 1}, got {len(data)}",
                "ShortRead",
            )
        return data

    def _list(self, prefix: str) -> list[Listed]:
        try:
            return list(self.client.list_blobs(prefix))
        except AzureNotFound as exc:
            raise UsageError(
                f"container {self.client.container} of {self.location} does not exist"
            ) from exc

    # -- writing -----------------------------------------------------------------------

    def acquire_writer(self) -> None:
        self.check_container()
        self.writer_lease.acquire()

    def release_writer(self) -> None:
        self.writer_lease.release()

    def begin_generation(self, generation_id: str) -> AzureStagingArea:
        self.immutability.check_container()  # refuse before uploading, not after
        return AzureStagingArea(self, generation_id)

    def join_generation(self, generation_id: str) -> AzureStagingArea:
        return AzureStagingArea(self, generation_id, joined=True)

    # -- lifecycle ---------------------------------------------------------------------

    def remove_stale_staging(self, older_than: float | None = None) -> list[str]:
        return remove_stale_attempts(self, older_than)

    def replace_manifest(
        self, ref: GenerationRef, manifest: bytes, signature: bytes | None, *, replaces: bytes
    ) -> None:
        """Key rotation's one change to a published generation: signature first, then
        the manifest with ``If-Match`` on the ETag of the verified bytes."""
        from ckptvault.storage.azure.replace import replace_manifest

        replace_manifest(self, ref, manifest, signature, replaces)

    # -- versions and immutability (RetainingStore) --------------------------------------

    def delete_generation_reporting(self, ref: GenerationRef) -> list[RetainedCopy]:
        return delete_generation(self, ref)

    def retained_until(self, ref: GenerationRef) -> str | None:
        try:
            hold = blob_hold(self.client, self.layout.generation_key(ref.name, MANIFEST_NAME))
        except AzureNotFound:
            return None
        return hold[0] if hold is not None else None

    def set_lock_rule(self, rule: LockRule | None) -> None:
        self.immutability.rule = rule

    def lock_policy(self) -> Immutability:
        return self.immutability

    # -- records -----------------------------------------------------------------------

    def listed_keys(self, prefix: str) -> list[tuple[str, int]]:
        return [(item.key, item.size) for item in self._list(prefix)]

    def read_head(self, key: str, limit: int) -> bytes:
        return self.client.get_range(key, 0, limit + 1)

    def url_of(self, key: str) -> str:
        return self.client.url(key)

    def put_record(self, kind: str, name: str, data: dict[str, Any]) -> None:
        self.client.put(self.layout.record_key(kind, name), encode_record(data))

    def delete_record(self, kind: str, name: str) -> None:
        key = self.layout.record_key(kind, name)
        self.client.delete(key)
        purge_key(self.client, key)  # no earlier versions of marks and leases pile up
