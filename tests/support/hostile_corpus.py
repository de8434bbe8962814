"""The corpus of hostile generations (issue 13 item 4): one named builder per attack.

Each :class:`Hostile` entry plants one hostile generation into a copy of a store
with good generations (a :class:`~hostile_plants.Plot`) and says how it must be
refused: the reason code (``ckptvault.trust.problems``; the stable, public name of
the rule that catches it), the typed error a restore of that step raises
(``NoValidCheckpoint``, or ``RollbackError`` when the floor refuses it), and which
step a plain restore falls back to (``None``: it must refuse). ``tests/
test_hostile_corpus.py`` runs every entry through every reader entry point and also
checks that no code runs, nothing outside the store is read, and memory stays
bounded.

Builders return the hostile generation's step. They live by category in
:mod:`hostile_corpus_files` (pickle payloads, paths and links),
:mod:`hostile_corpus_claims` (enormous claims, malformed JSON),
:mod:`hostile_corpus_trust` (signatures, other runs, the floor, encrypted replay)
and :mod:`hostile_corpus_indexes` / :mod:`hostile_corpus_index_files` (format 3:
what the root's index records and tensor table and the indexes say; the index files'
names, links, JSON and sizes); :func:`entries` gathers them.

Generations are planted in the format the writer produces now (3) and, for an
attack on anything format 2 has too, in format 2 as well (``formats``): the reader
still accepts format 2, so an attacker can plant it, and an attack on the
manifest's ``dcp`` section or its ``chunks`` lists is one on format 2's own
structures. The format-2 entry is named after the builder with ``-in-format-2``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from ckptvault.errors import NoValidCheckpoint
from support.hostile_plants import (
    Plot,
)

PICKLE = "hostile: pickle payloads"
PATHS = "hostile: paths and links"
CLAIMS = "hostile: enormous claims"
JSON = "hostile: malformed JSON"
TRUST = "hostile: trust (unsigned/forged/other run/rollback)"
REPLAY = "hostile: encrypted replay"
INDEXES = "hostile: format-3 indexes and tensor table"

# What an entry point cannot see by design; there it must still fail safe (no raw
# error, no code run, nothing outside the store read, bounded memory), whatever it
# concludes. ``verify`` takes no key store (an encrypted manifest's MAC and the
# ciphertext's authentication are left to restore and export) and applies no restore
# floor; ``inspect`` shows what a generation holds and takes no trusted keys; export
# never rewinds a run, so it applies abandonment but not the floor.
KEYED = frozenset({"manifest-unauthenticated", "authentication-failed", "key-unavailable"})
FLOOR = frozenset({"rollback", "generation-missing"})
SIGNATURE = frozenset({"signature-missing", "signature-untrusted", "signature-invalid"})
BLIND: dict[str, frozenset[str]] = {
    "verify": KEYED | FLOOR,
    "cli verify": KEYED | FLOOR,
    "cli inspect": KEYED | FLOOR | SIGNATURE | {"run-mismatch", "digest-mismatch"},
    "export": FLOOR,
}


@dataclass(frozen=True)
class Hostile:
    name: str
    category: str
    base: str  # "plain", "signed" or "encrypted" (see hostile_plants.Bases)
    plant: Callable[[Plot], int]
    code: str  # the reason code every entry point that can see it reports
    restores: int | None = 1  # the step a plain restore falls back to; None: refuses
    refusal: type[NoValidCheckpoint] = NoValidCheckpoint  # restore(step=...) raises exactly this
    blind: frozenset[str] = frozenset()  # entry points that do not reach the failing check

    def sees(self, point: str) -> bool:
        return point not in self.blind and self.code not in BLIND.get(point, frozenset())


CORPUS: list[Hostile] = []


def entries(category: str | None = None) -> list[Hostile]:
    """Every corpus entry (of ``category``), in the order they are defined."""
    for part in ("claims", "files", "index_files", "indexes", "trust"):
        importlib.import_module(f"support.hostile_corpus_{part}")  # each registers its entries

    return [entry for entry in CORPUS if category in (None, entry.category)]


def hostile(
    category: str,
    base: str,
    code: str,
    *,
    restores: int | None = 1,
    refusal: type[NoValidCheckpoint] = NoValidCheckpoint,
    blind: frozenset[str] = frozenset(),
    formats: tuple[int, ...] = (3,),
) -> Callable[[Callable[[Plot], int]], Callable[[Plot], int]]:
    """Register the decorated builder as a corpus entry named after it, once per
    format in ``formats`` (the builder reads ``plot.format`` where they differ)."""

    def register(plant: Callable[[Plot], int]) -> Callable[[Plot], int]:
        name = plant.__name__.replace("_", "-")
        for version in formats:
            named, based = (name, base) if version == 3 else (f"{name}-in-format-2", f"{base}-f2")
            entry = Hostile(named, category, based, plant, code, restores, refusal, blind)
            assert all(other.name != named for other in CORPUS), named
            CORPUS.append(entry)
        return plant

    return register
