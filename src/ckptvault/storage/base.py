"""The seam between ckptvault and where bytes live.

A :class:`Store` lists published generations, reports and opens their entries, and
hands out a :class:`StagingArea` per save attempt, which its backend's
:class:`PublishRule` turns into a visible generation atomically. Everything above
this layer (writer, reader, restore checks, manager, CLI) talks only to these
protocols: it never sees a directory, a hard-link count or a rename. Those are facts
of one backend, checked inside it. A new backend implements these protocols and
passes the conformance suite (``tests/storage/test_store_conformance.py``).

Rules every backend keeps (DESIGN rule 5, the store is hostile ground):

- listing never returns staging areas or the store's own control entries;
- an entry that is not a plain file the backend wrote (a link, a special file, a
  nested container) is reported with ``EntryInfo.unsafe`` and never opened;
- opening a file checks what was opened, not only what was listed;
- nothing outside the store is ever written, deleted or followed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from io import RawIOBase
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from ckptvault.format.layout import GenerationName
from ckptvault.storage.records import RecordFilter

AreaT = TypeVar("AreaT", contravariant=True)


@dataclass(frozen=True)
class GenerationRef:
    """A published generation as listed by its store (not yet verified)."""

    name: GenerationName
    location: str  # absolute path or URL, for people; never written into manifests

    @property
    def step(self) -> int:
        return self.name.step

    @property
    def generation_id(self) -> str:
        return self.name.generation_id


@dataclass(frozen=True)
class EntryInfo:
    """One entry of a generation as its store sees it, without following anything.

    ``unsafe`` is ``None`` for a plain file the store would serve; otherwise it says
    what the entry is instead ("is a symlink", "is hard-linked (2 names share it)"),
    and the store refuses to open it.
    """

    name: str
    size: int
    unsafe: str | None = None


class WritableFile(Protocol):
    """A file being written into a staging area."""

    def write(self, data: bytes | bytearray | memoryview) -> int: ...

    def commit(self) -> None:
        """Make the bytes durable (flush, fsync) and close."""

    def abort(self) -> None:
        """Close without committing; the staging area is discarded anyway."""


class StagingArea(Protocol):
    """Where one save attempt writes a generation before it becomes visible."""

    generation_id: str

    def create_file(self, name: str) -> WritableFile:
        """A new, empty file; ``name`` is a plain name never used before in this area."""

    def publish(self, step: int, manifest: bytes, signature: bytes | None = None) -> GenerationRef:
        """Write the manifest (and its signature) last and make the generation
        visible atomically, by the store's publish rule."""

    def abort(self) -> None:
        """Remove everything written; nothing becomes visible. Safe to call twice.
        A joined area (:meth:`Store.join_generation`) removes only its own files."""

    def release(self) -> None:
        """A joined area: let go of it once the beginning rank published (or removed)
        it; its files stay. Closes what it holds open. Safe to call twice."""

    def adopt(self, names: list[str]) -> None:
        """Files other ranks wrote into this attempt (a multi-rank save): publish
        covers them too (an object store's Object Lock), and abort removes them."""

    def read_staged(self, name: str, limit: int) -> bytes:
        """The bytes of file ``name`` of this attempt (written by any rank and
        committed), at most ``limit``: the coordinator reads back what other ranks
        announced before it publishes. OSError (EFBIG past ``limit``) or
        UnsafeEntryError for what is not a plain file."""


def write_new_file(area: StagingArea, name: str, data: bytes) -> None:
    """Write ``data`` as the new file ``name`` of ``area`` and commit it (durable on
    return); a failure aborts the file."""
    sink = area.create_file(name)
    try:
        sink.write(data)
    except BaseException:
        sink.abort()
        raise
    sink.commit()


class PublishRule(Protocol[AreaT]):
    """How a backend turns a fully written staging area into a visible generation.

    POSIX: write the manifest, fsync, rename the staging directory into place
    (:class:`ckptvault.storage.posix.AtomicRename`). An object store has no rename:
    its rule writes the manifest object last, conditionally. A staging area hands
    itself to its store's rule, so the rule is the one place a backend's publish
    order is written down.
    """

    def publish(
        self, area: AreaT, step: int, manifest: bytes, signature: bytes | None
    ) -> GenerationRef: ...


@runtime_checkable
class ListsManyGenerations(Protocol):
    """A store that lists the entries of many generations at once for less than one
    listing each: an object store lists its whole key space in pages of 1,000 keys,
    where listing one generation costs a request per key prefix it spreads over.
    ``ckptvault ls`` and ``generations()`` use it when a store offers it; a store
    without it is listed generation by generation with :meth:`Store.list_entries`."""

    def list_entries_of(
        self, refs: Sequence[GenerationRef]
    ) -> dict[GenerationName, dict[str, EntryInfo]]:
        """What :meth:`Store.list_entries` reports for each of ``refs`` (the same
        entries, sizes and ``unsafe`` verdicts); a generation nothing was found of maps
        to ``{}``. Raises ``OSError`` (or a ``CheckpointError``) when the store cannot
        be listed."""


@runtime_checkable
class Store(Protocol):
    """A checkpoint store: published generations plus one staging area per save."""

    location: str  # a path or URL, for messages

    # -- reading (never needs the writer lock, never changes anything) ------------------

    def list_generations(self) -> list[GenerationRef]:
        """Published generations, newest first (by step, then creation)."""

    def list_entries(self, ref: GenerationRef) -> dict[str, EntryInfo]:
        """Every entry of a generation. Raises :class:`UnsafeEntryError` when the
        generation itself is not what the store publishes (a link, say), and
        ``OSError`` when it cannot be listed."""

    def open_file(self, ref: GenerationRef, name: str) -> RawIOBase:
        """Open a plain file of a generation for reading, checking what was opened;
        ``UnsafeEntryError`` for anything else."""

    def read_range(self, ref: GenerationRef, name: str, offset: int, length: int) -> bytes:
        """Up to ``length`` bytes from ``offset`` (fewer only at the end of the file)."""

    def read_bytes(self, ref: GenerationRef, name: str, limit: int) -> bytes:
        """The whole file; ``OSError`` (EFBIG) when it is longer than ``limit``."""

    def holds_path(self, path: Path) -> bool:
        """Whether a local path lies inside this store. Control-plane state (keys,
        ledger, audit log) must not: a copy of the store would carry it, and whoever
        can write the store could change it."""

    # -- writing ----------------------------------------------------------------------

    def acquire_writer(self) -> None:
        """Take the single-writer lock (creating the store if needed); raises
        StoreLockedError when another live process holds it."""

    def release_writer(self) -> None: ...

    def begin_generation(self, generation_id: str) -> StagingArea: ...

    def join_generation(self, generation_id: str) -> StagingArea:
        """The staging area another rank of the job began (a multi-rank save): files
        can be created in it, but only the beginning rank publishes."""

    def check_capacity(self, nbytes: int, nfiles: int) -> None:
        """Raise ``StorageFullError`` (naming the bytes needed and free) when a save of
        about ``nbytes`` in ``nfiles`` files would not fit, before anything is written.
        Backends without a meaningful limit (object stores) accept everything."""

    # -- lifecycle (garbage collection, retention) ------------------------------------

    def remove_stale_staging(self, older_than: float | None = None) -> list[str]:
        """Delete what crashed saves left behind (staging areas, incomplete uploads);
        returns what was removed.

        ``older_than=None``: whatever the backend can prove dead. On POSIX that is
        every leftover, and it needs the writer lock (``UsageError`` otherwise); an
        object store has no lock that proves an upload dead, so it removes nothing.
        ``older_than=SECONDS``: leftovers whose newest write is older than that, never
        one that is still making progress (``ckptvault gc --stale-after``).
        """

    def delete_generation(self, ref: GenerationRef) -> None:
        """Remove a published generation: first what makes it a generation (POSIX:
        an atomic rename out of the listing; object stores: the manifest), so that
        no reader ever takes the rest for one, then its bytes. Idempotent."""

    def replace_manifest(
        self, ref: GenerationRef, manifest: bytes, signature: bytes | None, *, replaces: bytes
    ) -> None:
        """Replace a published generation's manifest (and signature): the one change
        ever made to a published generation, for key rotation, which rewrites only
        the key wrapping (``ckptvault.ops.rotation.rotate``), and for adopting signatures
        (``ckptvault.ops.signing.sign``: the same manifest bytes, a signature added). Never
        touches a data file.

        Needs the writer lock. ``replaces`` is the exact manifest the caller verified;
        when the stored one differs, nothing is written (``IntegrityError``). The
        signature is written first, then the manifest, each atomically, so a crash
        leaves the old pair, the new signature beside the old manifest (refused by a
        signature check until the rotation resumes), or the new pair. ``signature``
        None is for unsigned generations: a generation holding a ``manifest.sig`` is
        refused (``UsageError``) rather than left with a signature of other bytes."""

    # -- records: small JSON documents about generations (marks, pins, leases) --------
    #
    # Whoever can write the store can write these too, so a record may only withhold
    # a generation from restore or keep one from deletion; it never makes bytes count
    # as verified. ``kind`` is a lowercase word; ``name`` a plain file-name-like key.

    def put_record(self, kind: str, name: str, data: dict[str, Any]) -> None:
        """Create or replace one record, atomically."""

    def list_records(
        self, kind: str, accept: RecordFilter | None = None, limit: int | None = None
    ) -> dict[str, dict[str, Any]]:
        """Every well-formed record of ``kind`` by name; malformed ones are skipped.
        Only names ``accept`` takes are read (all when None), at most ``limit`` of them
        in name order (:func:`ckptvault.storage.records.records_to_read`)."""

    def delete_record(self, kind: str, name: str) -> None:
        """Remove one record; missing is fine."""
