"""Listing a store's generations for people and tools (no verification, no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from ckptvault.errors import CheckpointError
from ckptvault.format.layout import MANIFEST_NAME, generation_created_at
from ckptvault.format.manifest import MAX_MANIFEST_BYTES, parse_manifest
from ckptvault.storage.base import Store


@dataclass(frozen=True)
class GenerationInfo:
    """A published generation as listed: ``bytes`` and ``created_at`` come from its
    manifest when that parses, otherwise from the directory and the generation id.
    Listed is not verified: ``ckptvault verify`` and ``restore`` check the bytes."""

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
    """Every published generation, newest first."""
    infos = []
    for ref in store.list_generations():
        created_at = generation_created_at(ref.generation_id)
        try:
            manifest = parse_manifest(
                store.read_bytes(ref, MANIFEST_NAME, MAX_MANIFEST_BYTES), ref.location
            )
            size, created_at = manifest.total_bytes, manifest.created_at
        except (OSError, CheckpointError):
            try:
                size = sum(e.size for e in store.list_entries(ref).values() if e.unsafe is None)
            except (OSError, CheckpointError):
                size = 0
        infos.append(GenerationInfo(ref.step, ref.generation_id, ref.location, size, created_at))
    return infos
