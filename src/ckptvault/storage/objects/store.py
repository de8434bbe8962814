"""What every object store's ``Store`` shares: its worker threads and the one rule of
which key a name is served from.

:class:`ObjectStoreBase` starts a store's upload threads
(:class:`~ckptvault.storage.objects.uploads.PartUploader`) and read threads on first
use, names its generations, and keeps each generation's last listing for
:data:`ENTRY_CACHE_SECONDS`: restore lists a generation once, then opens every file
(twice), and listing 17 prefixes per open would dominate. Reads stay safe either
way: :meth:`ObjectStoreBase.served_key` serves only the one key a name maps to, and
never a name its listing judged unsafe. A backend (S3, Azure Blob) subclasses it and
supplies ``list_entries``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from ckptvault.errors import UnsafeEntryError
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME, GenerationName
from ckptvault.format.manifest import is_safe_file_name
from ckptvault.storage.base import EntryInfo, GenerationRef
from ckptvault.storage.objects.errors import ObjectStoreError
from ckptvault.storage.objects.layout import ObjectLayout
from ckptvault.storage.objects.uploads import PartUploader
from ckptvault.storage.records import (
    MAX_RECORD_BYTES,
    RecordFilter,
    check_record_key,
    decode_record,
    record_name_of,
    records_to_read,
)
from ckptvault.storage.retained import RetainedCopy, locked_until

logger = logging.getLogger("ckptvault")

ENTRY_CACHE_SECONDS = 30.0


class LockPolicy(Protocol):
    """How a store puts published objects under retention (S3 Object Lock, Azure
    immutability policies): for how many days, and locking now."""

    days: int | None

    def lock_now(self, keys: list[str], pool: ThreadPoolExecutor) -> datetime | None: ...


class ObjectStoreBase:
    """Threads, generation names and served keys of an object store (see the module)."""

    location: str
    layout: ObjectLayout

    def __init__(self, max_concurrency: int, threads: str) -> None:
        self._max_concurrency = max_concurrency
        self._threads = threads  # thread name prefix, e.g. "ckptvault-s3"
        self._mutex = threading.Lock()
        self._uploader: PartUploader | None = None
        self._read_pool: ThreadPoolExecutor | None = None
        self._entries: dict[GenerationName, tuple[float, dict[str, EntryInfo]]] = {}

    def list_entries(self, ref: GenerationRef) -> dict[str, EntryInfo]:
        raise NotImplementedError

    def delete_generation_reporting(self, ref: GenerationRef) -> list[RetainedCopy]:
        raise NotImplementedError

    def lock_policy(self) -> LockPolicy:
        """The store's retention of published objects."""
        raise NotImplementedError

    def listed_keys(self, prefix: str) -> list[tuple[str, int]]:
        """``(key, size)`` of every object under ``prefix``."""
        raise NotImplementedError

    def read_head(self, key: str, limit: int) -> bytes:
        """At most ``limit`` + 1 bytes of ``key`` from its start (``ObjectStoreError``)."""
        raise NotImplementedError

    def url_of(self, key: str) -> str:
        raise NotImplementedError

    def lock_generation(self, ref: GenerationRef) -> str | None:
        """Put a published generation's objects under retention now (a pin)."""
        policy = self.lock_policy()
        if policy.days is None:
            return None
        entries = self.list_entries(ref)
        keys = [self.layout.key_of(ref.name, n) for n, e in sorted(entries.items()) if not e.unsafe]
        until = policy.lock_now(keys, self.read_pool)
        return locked_until(until) if until is not None else None

    def list_records(
        self, kind: str, accept: RecordFilter | None = None, limit: int | None = None
    ) -> dict[str, dict[str, Any]]:
        """Every well-formed record of ``kind``: names ``accept`` takes, at most
        ``limit``, each read with a size bound; one that went or cannot be read is
        skipped like a malformed one."""
        check_record_key(kind, "x")
        prefix = self.layout.records_prefix(kind)
        listed = {}
        for key, size in self.listed_keys(prefix):
            name = record_name_of(key[len(prefix) :])  # None for nested keys
            if name is not None and size <= MAX_RECORD_BYTES:
                listed[name] = key
        records = {}
        for name in records_to_read(listed, kind, self.url_of(prefix), accept, limit):
            key = listed[name]
            try:
                raw = self.read_head(key, MAX_RECORD_BYTES)
            except ObjectStoreError:
                continue
            data = decode_record(raw, self.url_of(key))
            if data is not None:
                records[name] = data
        return records

    def delete_generation(self, ref: GenerationRef) -> None:
        """Delete ``ref`` with every version of its objects; a copy the store must keep
        (a lock, a legal hold) is logged, not raised (retention reports them)."""
        for copy in self.delete_generation_reporting(ref):
            logger.warning(
                "%s (version %s) of deleted generation %s stays: %s",
                copy.location,
                copy.version_id,
                ref.generation_id,
                copy.reason,
            )

    @property
    def uploader(self) -> PartUploader:
        with self._mutex:
            if self._uploader is None:
                self._uploader = PartUploader(self._max_concurrency)
            return self._uploader

    @property
    def read_pool(self) -> ThreadPoolExecutor:
        with self._mutex:
            if self._read_pool is None:
                self._read_pool = ThreadPoolExecutor(
                    self._max_concurrency, thread_name_prefix=f"{self._threads}-read"
                )
            return self._read_pool

    def ref_for(self, name: GenerationName) -> GenerationRef:
        return GenerationRef(name=name, location=f"{self.location}/generations/{name.dirname}")

    def holds_path(self, path: Path) -> bool:
        return False  # nothing of an object store lies on a local filesystem

    def check_capacity(self, nbytes: int, nfiles: int) -> None:
        """An object store has no free-space limit to check."""

    def remember_entries(self, ref: GenerationRef, entries: dict[str, EntryInfo]) -> None:
        """Keep ``ref``'s listing for the reads that follow it."""
        with self._mutex:
            self._entries[ref.name] = (time.monotonic(), entries)

    def forget_entries(self, ref: GenerationRef) -> None:
        with self._mutex:
            self._entries.pop(ref.name, None)

    def served_key(self, ref: GenerationRef, name: str) -> str:
        """The one key ``name`` is served from; ``UnsafeEntryError`` for a name the
        listing found anywhere else, or one ckptvault never writes."""
        where = f"{ref.location}/{name}"
        if name not in (MANIFEST_NAME, SIGNATURE_NAME) and not is_safe_file_name(name):
            raise UnsafeEntryError(f"{where} is not a plain file name; refusing to read it")
        with self._mutex:
            listed_at, entries = self._entries.get(ref.name, (-1e18, {}))
        if time.monotonic() - listed_at > ENTRY_CACHE_SECONDS:
            entries = self.list_entries(ref)
        entry = entries.get(name)
        if entry is not None and entry.unsafe is not None:
            raise UnsafeEntryError(f"{where} {entry.unsafe}, not a plain file; refusing to read it")
        return self.layout.key_of(ref.name, name)
