"""Listing a store's generations for people and tools (no verification, no torch).

Listing reads no file at all, manifests included: a store's writer chooses their
bytes, and ``ls`` or ``generations()`` must cost the same however large or deep a
planted manifest is. Sizes come from the store's listing of each generation's
entries, creation times from the generation ids. Generations retention marked for
deletion are left out unless asked for (``include_marked``), with their mark.

What a listing of N generations costs: one listing of the generations, one of the
deletion marks (reading only the marks of listed generations), and the entries of
each generation shown: N directory listings on POSIX; on a store that lists many
generations at once (:class:`~ckptvault.storage.base.ListsManyGenerations`: S3), a
paginated listing of its key space instead of 17 listings per generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptvault.errors import CheckpointError
from ckptvault.format.layout import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    GenerationName,
    generation_created_at,
)
from ckptvault.storage.base import EntryInfo, GenerationRef, ListsManyGenerations, Store
from ckptvault.storage.records import DELETION_MARK


@dataclass(frozen=True)
class GenerationInfo:
    """A published generation as listed: ``bytes`` is the size of its data files (every
    plain entry but the manifest and its signature, as the manifest would count them)
    and ``created_at`` the time in its generation id. Listed is not verified:
    ``ckptvault verify`` and ``restore`` check the bytes. ``marked_at`` and
    ``mark_reason`` are set for a generation retention marked for deletion."""

    step: int
    generation_id: str
    path: str
    bytes: int
    created_at: str
    marked_at: str | None = None
    mark_reason: str | None = None

    def to_json(self) -> dict[str, object]:
        listed: dict[str, object] = {
            "step": self.step,
            "generation_id": self.generation_id,
            "path": self.path,
            "bytes": self.bytes,
            "created_at": self.created_at,
        }
        if self.marked_at is not None:
            listed["marked"] = {"marked_at": self.marked_at, "reason": self.mark_reason}
        return listed


def _marks(store: Store, refs: list[GenerationRef]) -> dict[str, dict[str, Any]]:
    """The marks of the listed generations: no other record is even read."""
    dirnames = {ref.name.dirname for ref in refs}
    try:
        return store.list_records(DELETION_MARK, dirnames.__contains__)
    except (OSError, CheckpointError):
        return {}


def _data_bytes(entries: dict[str, EntryInfo]) -> int:
    return sum(
        entry.size
        for name, entry in entries.items()
        if entry.unsafe is None and name not in (MANIFEST_NAME, SIGNATURE_NAME)
    )


def _sizes(store: Store, refs: list[GenerationRef]) -> dict[GenerationName, int]:
    """The data bytes of each generation; 0 for one that cannot be listed."""
    if isinstance(store, ListsManyGenerations):
        try:
            listed = store.list_entries_of(refs)
        except (OSError, CheckpointError):
            return {}
        return {name: _data_bytes(entries) for name, entries in listed.items()}
    sizes = {}
    for ref in refs:
        try:
            sizes[ref.name] = _data_bytes(store.list_entries(ref))
        except (OSError, CheckpointError):
            sizes[ref.name] = 0
    return sizes


def list_generation_infos(store: Store, include_marked: bool = False) -> list[GenerationInfo]:
    """Every published generation, newest first; parses no manifest. Generations
    marked for deletion only with ``include_marked`` (and then with their mark)."""
    infos = []
    refs = store.list_generations()
    marks = _marks(store, refs)
    shown = [ref for ref in refs if include_marked or ref.name.dirname not in marks]
    sizes = _sizes(store, shown)
    for ref in shown:
        mark = marks.get(ref.name.dirname)
        size = sizes.get(ref.name, 0)
        created_at = generation_created_at(ref.generation_id)
        marked_at = reason = None
        if mark is not None:
            marked_at, reason = str(mark.get("marked_at", "?")), str(mark.get("reason", ""))
        infos.append(
            GenerationInfo(
                ref.step, ref.generation_id, ref.location, size, created_at, marked_at, reason
            )
        )
    return infos
