"""One candidate list over several tiers (a fast local store and a durable copy).

Each tier's :class:`~ckptvault.restoring.selector.CandidateSelector` selects from its
own listing; restore then tries every generation newest first across them, the local
copy of a generation before a remote one. A generation the ledger saw published is
missing only when no tier lists it, and a generation newer than the step asked for
counts whichever tier holds it.
"""

from __future__ import annotations

from dataclasses import replace

from ckptvault.format.layout import GenerationName
from ckptvault.restoring.selector import Selection
from ckptvault.storage.base import GenerationRef, Store


def merge_tiers(
    tiers: list[tuple[Store, Selection]],
) -> tuple[Selection, dict[str, Store]]:
    """One selection over several tiers: newest generation first and, for the same
    generation, the tiers in their order (local first). A generation the ledger saw
    published is missing only when no tier lists it: then one placeholder stands for
    it (a refusal counted once), otherwise the tiers' real copies do."""
    listed_names = {ref.name for _store, sel in tiers for ref in sel.listed}
    placeholders: dict[GenerationName, GenerationRef] = {}
    for _store, sel in tiers:
        for ref in sel.missing:
            if ref.name not in listed_names:
                placeholders.setdefault(ref.name, ref)
    missing = frozenset(placeholders.values())
    ordered = [
        (ref, rank, store)
        for rank, (store, sel) in enumerate(tiers)
        for ref in sel.candidates
        if ref not in sel.missing or ref in missing
    ]
    ordered.sort(key=lambda item: item[1])  # stable: tier order within a generation
    ordered.sort(key=lambda item: item[0].name, reverse=True)
    base = tiers[0][1]
    merged = replace(
        base,
        candidates=[ref for ref, _rank, _store in ordered],
        listed=list({ref.generation_id: ref for _s, sel in tiers for ref in sel.listed}.values()),
        skipped=[],
        missing=missing,
        newer=frozenset(ref for _store, sel in tiers for ref in sel.newer),
        passed_over=[],
        absent=None,
    )
    return merged, {ref.location: store for ref, _rank, store in ordered}
