"""The seam between ckptvault and where bytes live.

A :class:`Store` lists published generations, opens their files, and turns a
:class:`StagingArea` into a published generation atomically. Everything above this
layer (writer, reader, checks, manager) talks only to these protocols, so an object
store backend is an addition, not a rewrite.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import BinaryIO, Protocol

from ckptvault.format.layout import GenerationName


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
    """One entry of a generation as the store sees it, without following links."""

    name: str
    size: int
    kind: str  # "file", "symlink", "dir" or "other"
    links: int = 1  # hard-link count; more than one means another name shares the bytes


class WritableFile(Protocol):
    """A file being written into a staging area."""

    def write(self, data: bytes | bytearray | memoryview) -> int: ...

    def commit(self) -> None:
        """Make the bytes durable (flush, fsync) and close."""

    def abort(self) -> None:
        """Close without committing; the staging area is discarded anyway."""


class StagingArea(Protocol):
    """Where one generation is written before it becomes visible."""

    generation_id: str

    def create_file(self, name: str) -> WritableFile: ...

    def publish(self, step: int, manifest: bytes, signature: bytes | None = None) -> GenerationRef:
        """Write the manifest (and its signature) last and make the generation
        visible atomically."""

    def abort(self) -> None:
        """Remove everything written; nothing becomes visible."""


class Store(Protocol):
    location: str

    def list_generations(self) -> list[GenerationRef]:
        """Published generations, newest first (by step, then creation)."""

    def generation_kind(self, ref: GenerationRef) -> str:
        """``"dir"`` for a plain generation directory; anything else is refused."""

    def list_entries(self, ref: GenerationRef) -> dict[str, EntryInfo]: ...

    def open_file(self, ref: GenerationRef, name: str) -> BinaryIO: ...

    def read_bytes(self, ref: GenerationRef, name: str, limit: int) -> bytes: ...

    def acquire_writer(self) -> None:
        """Take the single-writer lock; raises StoreLockedError when held elsewhere."""

    def release_writer(self) -> None: ...

    def remove_stale_staging(self) -> list[str]:
        """Delete staging leftovers of crashed saves; only while holding the lock."""

    def begin_generation(self, generation_id: str) -> StagingArea: ...
