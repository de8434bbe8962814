"""Listing a store's generations for people and tools (no verification, no torch).

Listing reads no file at all, manifests included: a store's writer chooses their
bytes, and ``ls`` or ``generations()`` must cost the same however large or deep a
planted manifest is. Sizes come from the store's listing of each generation's
entries, creation times from the generation ids.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptvault.errors import CheckpointError
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME, generation_created_at
from ckptvault.storage.base import Store


@dataclass(frozen=True)
class GenerationInfo:
    """A published generation as listed: ``bytes`` is the size of its data files (every
    plain entry but the manifest and its signature, as the manifest would count them)
    and ``created_at`` the time in its generation id. Listed is not verified:
    ``ckptvault verify`` and ``restore`` check the bytes."""

    step: int
    generation_id: str
    path: str
    bytes: int
    created_at: str

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "generation_id": self.generation_id,
            "path": self.path,
            "bytes": self.bytes,
            "created_at": self.created_at,
        }


def list_generation_infos(store: Store) -> list[GenerationInfo]:
    """Every published generation, newest first; parses no manifest."""
    infos = []
    for ref in store.list_generations():
        try:
            size = sum(
                entry.size
                for name, entry in store.list_entries(ref).items()
                if entry.unsafe is None and name not in (MANIFEST_NAME, SIGNATURE_NAME)
            )
        except (OSError, CheckpointError):
            size = 0
        created_at = generation_created_at(ref.generation_id)
        infos.append(GenerationInfo(ref.step, ref.generation_id, ref.location, size, created_at))
    return infos
