"""Keys of an object store (S3, Azure Blob), and what a generation's listing means.

Everything of a store lives under its prefix (``s3://bucket/<prefix>/``, ``az://container/<prefix>/``)::

    generations/step-<step>.<generation id>/manifest.json   the generation exists iff this does
    generations/step-<step>.<generation id>/manifest.sig    its detached signature (if signed)
    data/<x>/<generation id>/<file name>                    the attempt's data files
    .records/<kind>/<name>.json                             store records (marks, pins, leases)
    .writer.lock                                            the writer lease
    .probe/<token>                                          conditional-write probes (deleted)

``<x>`` is one hex digit, the first of BLAKE3(``"<generation id>:<rank>"``), with the
rank read from the file name's ``r<5 digits>-`` prefix (0 otherwise): the files of
many ranks writing at once spread over 16 key prefixes instead of all landing on one
(S3 scales request rates per prefix; Azure partitions by name range). Each save attempt writes under its own
generation id, so attempts never share a key, and every key is built from a
validated generation id and a plain file name.

A generation's entries are the objects of its 16 data prefixes plus its own prefix.
Where a name must live follows from the name, so anything found elsewhere — nested
deeper, under the wrong spread prefix, beside the manifest, a name that is not a
plain file name, the same name twice — is reported with ``EntryInfo.unsafe``: the
store only ever serves the one key where ckptvault itself writes a name.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import blake3

from ckptvault.errors import UsageError
from ckptvault.format.layout import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    GenerationName,
    is_generation_id,
    parse_generation_dirname,
)
from ckptvault.format.manifest import is_safe_file_name
from ckptvault.storage.base import EntryInfo
from ckptvault.storage.records import RECORD_SUFFIX, RECORDS_DIR, check_record_key

GENERATIONS = "generations/"
DATA = "data/"
SPREAD_DIGITS = "0123456789abcdef"
LOCK_NAME = ".writer.lock"
PROBE_DIR = ".probe/"
OWN_PREFIX = "generation"  # where a name was found: its generation's own prefix

_RANK_RE = re.compile(r"^r([0-9]{5})-")


def rank_of(file_name: str) -> int:
    """The writing rank encoded in ``r<5 digits>-...`` file names; 0 for other names."""
    match = _RANK_RE.match(file_name)
    return int(match.group(1)) if match else 0


def spread_digit(generation_id: str, rank: int) -> str:
    """The data prefix digit of ``rank``'s files in one attempt (one of 16)."""
    return blake3.blake3(f"{generation_id}:{rank}".encode()).hexdigest()[0]


@dataclass(frozen=True)
class ObjectLayout:
    """Builds every key of a store under ``prefix`` ("" or ending in "/")."""

    prefix: str

    @property
    def generations_prefix(self) -> str:
        return self.prefix + GENERATIONS

    @property
    def data_root(self) -> str:
        return self.prefix + DATA

    @property
    def lock_key(self) -> str:
        return self.prefix + LOCK_NAME

    def probe_key(self, token: str) -> str:
        return f"{self.prefix}{PROBE_DIR}{token}"

    def generation_prefix(self, name: GenerationName) -> str:
        return f"{self.generations_prefix}{name.dirname}/"

    def generation_key(self, name: GenerationName, file_name: str) -> str:
        """The manifest or its signature; nothing else lives beside them."""
        if file_name not in (MANIFEST_NAME, SIGNATURE_NAME):
            raise UsageError(f"{file_name!r} does not live beside a manifest")
        return self.generation_prefix(name) + file_name

    def data_prefix(self, digit: str, generation_id: str) -> str:
        if digit not in SPREAD_DIGITS or len(digit) != 1 or not is_generation_id(generation_id):
            raise UsageError(f"invalid data prefix {digit!r}/{generation_id!r}")
        return f"{self.data_root}{digit}/{generation_id}/"

    def data_prefixes(self, generation_id: str) -> dict[str, str]:
        """Spread digit -> the attempt's data prefix under it, for all 16 digits."""
        return {digit: self.data_prefix(digit, generation_id) for digit in SPREAD_DIGITS}

    def data_key(self, generation_id: str, file_name: str) -> str:
        """Where ``file_name`` of attempt ``generation_id`` lives: its one key."""
        if not is_safe_file_name(file_name):
            raise UsageError(
                f"{file_name!r} is not a plain file name (letters, digits, '.', '_', '-'; "
                "not hidden, no '..', not a manifest name)"
            )
        digit = spread_digit(generation_id, rank_of(file_name))
        return self.data_prefix(digit, generation_id) + file_name

    def key_of(self, name: GenerationName, file_name: str) -> str:
        """The key a generation's entry ``file_name`` is served from."""
        if file_name in (MANIFEST_NAME, SIGNATURE_NAME):
            return self.generation_key(name, file_name)
        return self.data_key(name.generation_id, file_name)

    def records_prefix(self, kind: str) -> str:
        check_record_key(kind, "x")
        return f"{self.prefix}{RECORDS_DIR}/{kind}/"

    def record_key(self, kind: str, name: str) -> str:
        check_record_key(kind, name)
        return self.records_prefix(kind) + name + RECORD_SUFFIX

    def parse_manifest_key(self, key: str) -> GenerationName | None:
        """The generation whose manifest ``key`` is; None for any other key."""
        rest = key[len(self.generations_prefix) :]
        if not key.startswith(self.generations_prefix) or rest.count("/") != 1:
            return None
        dirname, _, file_name = rest.partition("/")
        return parse_generation_dirname(dirname) if file_name == MANIFEST_NAME else None

    def parse_data_key(self, key: str) -> tuple[str, str] | None:
        """``(spread digit, generation id)`` of a key this store writes under ``data/``:
        exactly ``data/<digit>/<generation id>/<safe file name>``, with the digit that
        file's rank spreads to (:meth:`data_key`). None for anything else: at a
        bucket's root, ``data/`` may hold another application's objects and uploads,
        and cleanup never touches a key this parses to None."""
        if not key.startswith(self.data_root):
            return None
        parts = key[len(self.data_root) :].split("/")
        if len(parts) != 3:
            return None
        digit, generation_id, file_name = parts
        if not is_generation_id(generation_id) or not is_safe_file_name(file_name):
            return None
        if digit != spread_digit(generation_id, rank_of(file_name)):
            return None
        return digit, generation_id


Listing = list[tuple[str, int]]  # (key below a prefix, size), in the store's key order


class ListingOverBudget(Exception):
    """A bulk listing met more keys than listing each generation alone would read."""


def keys_of_generations(
    listed: Iterable[tuple[str, int]], prefix: str, budget: int, kept: set[str], position: int
) -> Listing:
    """``(key, size)`` of the keys under ``prefix`` whose ``position``-th component
    (below ``prefix``) is in ``kept`` (a listed generation's name or id), in listing
    order; every other key is counted and passed over. :class:`ListingOverBudget` once
    more than ``budget`` keys were listed: the caller then lists each generation alone,
    so keys that belong to none (planted by the million, or another application's at a
    bucket's or container's root) never cost more than that."""
    found = []
    for count, (key, size) in enumerate(listed, 1):
        if count > budget:
            raise ListingOverBudget(prefix)
        parts = key[len(prefix) :].split("/", position + 1)
        if len(parts) > position + 1 and parts[position] in kept:
            found.append((key, size))
    return found


def listings_by_generation(
    layout: ObjectLayout,
    names: Iterable[GenerationName],
    generation_objects: Iterable[tuple[str, int]],
    data_objects: Iterable[tuple[str, int]],
) -> dict[GenerationName, dict[str, Listing]]:
    """Each generation's listings, place by place, cut out of one listing of every
    key under ``generations/`` and one under ``data/`` (``(key, size)`` pairs): for
    each of ``names``, exactly the objects the 17 prefix listings of that generation
    would return, in the same order, so that :func:`classify_entries` judges them as
    it judges a generation listed on its own. Any other key is passed over."""
    wanted = list(names)
    own: dict[str, Listing] = {name.dirname: [] for name in wanted}
    data: dict[str, dict[str, Listing]] = {
        name.generation_id: {digit: [] for digit in SPREAD_DIGITS} for name in wanted
    }
    for key, size in generation_objects:
        dirname, slash, rest = key[len(layout.generations_prefix) :].partition("/")
        if slash and key.startswith(layout.generations_prefix) and dirname in own:
            own[dirname].append((rest, size))
    for key, size in data_objects:
        digit, slash, below = key[len(layout.data_root) :].partition("/")
        generation_id, slash_too, rest = below.partition("/")
        places = data.get(generation_id) if slash and slash_too else None
        if places is not None and key.startswith(layout.data_root) and digit in places:
            places[digit].append((rest, size))
    return {name: {OWN_PREFIX: own[name.dirname], **data[name.generation_id]} for name in wanted}


@dataclass
class _Sighting:
    """One name as seen in a generation's listing: every place it was found."""

    places: list[str] = field(default_factory=list)
    size: int = 0
    nested: bool = False
    misplaced: str | None = None


def classify_entries(
    generation_id: str, listings: dict[str, list[tuple[str, int]]]
) -> dict[str, EntryInfo]:
    """A generation's entries from its listings: place (a spread digit, or
    :data:`OWN_PREFIX`) -> ``(key below that prefix, size)`` pairs.

    An entry is safe only when it is one plain object exactly where ckptvault writes
    that name; every other finding is reported unsafe under its first key component.
    """
    seen: dict[str, _Sighting] = {}
    for place, objects in sorted(listings.items()):
        for rest, size in objects:
            if not rest:
                continue  # a "folder" marker some tools create: not an entry
            name, nested, _ = rest.partition("/")
            name = name or rest
            sighting = seen.setdefault(name, _Sighting(size=size))
            sighting.places.append(place)
            sighting.nested = sighting.nested or bool(nested)
            sighting.misplaced = sighting.misplaced or _misplaced(generation_id, place, name)
    return {name: EntryInfo(name, s.size, _unsafe(s)) for name, s in seen.items()}


def _unsafe(sighting: _Sighting) -> str | None:
    if sighting.nested:
        return "holds nested keys"
    if len(sighting.places) > 1:
        where = ", ".join(_describe_place(p) for p in sighting.places)
        return f"is stored {len(sighting.places)} times ({where})"
    return sighting.misplaced


def _misplaced(generation_id: str, place: str, name: str) -> str | None:
    if place == OWN_PREFIX:
        if name in (MANIFEST_NAME, SIGNATURE_NAME):
            return None
        return "lies beside the manifest, where ckptvault writes no data file"
    if not is_safe_file_name(name):
        return "is not a plain file name ckptvault writes"
    expected = spread_digit(generation_id, rank_of(name))
    if place != expected:
        return f"lies under data/{place}/, not data/{expected}/ where its writer puts it"
    return None


def _describe_place(place: str) -> str:
    return "beside the manifest" if place == OWN_PREFIX else f"data/{place}/"
