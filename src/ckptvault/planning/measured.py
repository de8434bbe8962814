"""The size of a store's checkpoints, measured from a generation that is what it says.

``ckptvault plan --from STORE`` sizes its forecast by a published generation. The
listing alone cannot be trusted for that: whoever can write the store can plant an
empty directory with the newest step (the forecast then plans for 0-byte
checkpoints) or a sparse file of a terabyte. So the size is taken from the newest
generation whose manifest parses (bounded, :func:`~ckptvault.format.manifest.parse_manifest`),
names that generation's own step and id, and whose listed plain files have exactly
the sizes the manifest declares. Nothing is verified beyond that (``ckptvault
verify`` checks bytes and signatures); the search stops after
:data:`MAX_CANDIDATES` generations, so a store full of planted ones costs a bounded
number of small reads.
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptvault.errors import CheckpointError, UsageError
from ckptvault.format.layout import MANIFEST_NAME
from ckptvault.format.manifest import MAX_MANIFEST_BYTES, parse_manifest
from ckptvault.storage.base import GenerationRef, Store

MAX_CANDIDATES = 16


@dataclass(frozen=True)
class MeasuredGeneration:
    """The generation a size was measured from: its step, id and data bytes."""

    step: int
    generation_id: str
    bytes: int


def _consistent_size(store: Store, ref: GenerationRef) -> int | str:
    """The generation's data bytes as its manifest counts them, or why it cannot be
    used (its manifest, name and listing disagree)."""
    try:
        where = f"generation {ref.location}"
        manifest = parse_manifest(store.read_bytes(ref, MANIFEST_NAME, MAX_MANIFEST_BYTES), where)
        listed = {n: e.size for n, e in store.list_entries(ref).items() if e.unsafe is None}
    except (OSError, CheckpointError) as exc:
        return f"{ref.location}: {exc}"
    if (manifest.step, manifest.generation_id) != (ref.step, ref.generation_id):
        return f"{ref.location}: its manifest names step {manifest.step}, {manifest.generation_id}"
    sizes = {name: record.size for name, record in manifest.files.items()}
    sizes.update((name, record.size) for name, record in (manifest.indexes or {}).items())
    for name, size in sizes.items():
        if listed.get(name) != size:
            return f"{ref.location}: {name} is not listed at the {size} bytes declared"
    return manifest.stored_bytes


def measure_checkpoint(store: Store) -> MeasuredGeneration:
    """The newest generation (of the newest :data:`MAX_CANDIDATES`) whose manifest and
    listing agree, with its size; :class:`UsageError` saying why when none does."""
    refs = store.list_generations()
    if not refs:
        raise UsageError(
            f"store {store.location} holds no published generation to size; "
            "size the checkpoint with --params and --recipe instead"
        )
    problems = []
    for ref in refs[:MAX_CANDIDATES]:
        size = _consistent_size(store, ref)
        if isinstance(size, int):
            return MeasuredGeneration(ref.step, ref.generation_id, size)
        problems.append(size)
    raise UsageError(
        f"none of the newest {len(problems)} generations of {store.location} has a manifest "
        "that matches its files, so the checkpoint size cannot be measured ("
        + "; ".join(problems[:3])
        + "); run ckptvault verify on the store, or size it with --params and --recipe"
    )
