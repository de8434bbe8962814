"""What a store holds and how far its replica is behind, read from the store itself.

Shared by the manager's Prometheus metrics (:mod:`.prometheus`, at scrape time) and
``ckptvault status`` (:mod:`.health`). Everything here lists; nothing reads a
generation's files, so it costs the same however large the checkpoints are, and
nothing here is verified (``ckptvault verify`` checks bytes).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

from ckptvault.errors import CheckpointError
from ckptvault.format.layout import (
    generation_dirname,
    generation_id_time,
    parse_generation_dirname,
)
from ckptvault.storage.base import Store
from ckptvault.storage.listing import GenerationInfo, list_generation_infos
from ckptvault.storage.records import REPLICA as REPLICA_RECORD


@dataclass(frozen=True)
class FilesystemUse:
    """The filesystem a POSIX store lives on, as ``df`` counts it: ``used_fraction``
    is used / (used + available to unprivileged users)."""

    path: str
    total_bytes: int
    used_bytes: int
    available_bytes: int

    @property
    def used_fraction(self) -> float:
        room = self.used_bytes + self.available_bytes
        return self.used_bytes / room if room else 0.0

    def to_json(self) -> dict[str, object]:
        return {
            "path": self.path,
            "total_bytes": self.total_bytes,
            "used_bytes": self.used_bytes,
            "available_bytes": self.available_bytes,
            "used_fraction": round(self.used_fraction, 6),
        }


@dataclass(frozen=True)
class StoreUsage:
    """One listing of a store: its generations (marked ones included: their bytes are
    still there) and the filesystem under it (None for object stores)."""

    generations: tuple[GenerationInfo, ...]
    filesystem: FilesystemUse | None

    @property
    def used_bytes(self) -> int:
        return sum(info.bytes for info in self.generations)

    @property
    def live(self) -> list[GenerationInfo]:
        """Generations restore would consider (not marked for deletion), newest first."""
        return [info for info in self.generations if info.marked_at is None]


def filesystem_use(store: Store) -> FilesystemUse | None:
    """The filesystem use under a POSIX store (its nearest existing directory: a store
    not created yet lives where it will be); None for other stores."""
    from ckptvault.storage.posix.store import PosixStore

    if not isinstance(store, PosixStore):
        return None
    path = store.root
    while not path.exists() and path.parent != path:
        path = path.parent
    try:
        info = os.statvfs(path)
    except OSError:
        return None
    total = info.f_blocks * info.f_frsize
    used = (info.f_blocks - info.f_bfree) * info.f_frsize
    return FilesystemUse(str(store.root), total, used, info.f_bavail * info.f_frsize)


def store_usage(store: Store) -> StoreUsage:
    """List ``store`` once: generations (with their sizes and marks) and filesystem use.
    Raises what the store raises when it cannot be listed."""
    return StoreUsage(
        tuple(list_generation_infos(store, include_marked=True)), filesystem_use(store)
    )


def created_epoch(generation_id: str) -> float:
    """The Unix time in a generation id (when its save began)."""
    return generation_id_time(generation_id).timestamp()


# How far a generation id's time may run ahead of this clock (the writer's clock may
# be a little ahead): further, and the id was made up, not written by a save.
CLOCK_SKEW_S = 300.0


def is_future_dated(published_at: float, now: float) -> bool:
    """Whether ``published_at`` lies further in the future than clocks disagree by.

    Anyone who can write the store can name a directory with a generation id from
    the year 2099; taken as the newest publish it would keep the last good
    checkpoint's age at zero, and ``status`` and the metrics healthy, for ever.
    """
    return published_at > now + CLOCK_SKEW_S


def replicated_ids(store: Store, live: Iterable[GenerationInfo]) -> set[str]:
    """Ids of the ``live`` generations the store's replica records say were copied to
    another tier, verified (:class:`~ckptvault.replication.replicator.Replicator` writes
    one after each copy). Empty when none is readable. Only the records of ``live``
    generations are read, judged by name first: records planted by the thousand cost a
    listing, not a read each."""
    wanted = {generation_dirname(info.step, info.generation_id) for info in live}
    try:
        names = store.list_records(REPLICA_RECORD, wanted.__contains__)
    except (OSError, CheckpointError):
        return set()
    parsed = (parse_generation_dirname(name) for name in names)
    return {name.generation_id for name in parsed if name is not None}


def replication_lag(
    generations: Iterable[tuple[str, float]], replicated: set[str], now: float
) -> float | None:
    """How long the replica has been behind, in seconds, from ``(generation id,
    published at)`` pairs of the local tier and the ids known to be replicated.

    0 when the newest generation is replicated; otherwise the age of the oldest
    generation newer than the newest replicated one (what a lost local tier would
    take with it has been at risk that long). None when no generation was ever
    replicated: replication is then not seen to be set up at all. Generations older
    than the newest copy are not counted: a copy that was given up (its source does
    not verify) must not hold the lag up for ever.
    """
    ordered = sorted(generations, key=lambda pair: pair[0], reverse=True)  # ids sort by time
    if not replicated:
        return None
    waiting: list[float] = []
    for generation_id, published_at in ordered:
        if generation_id in replicated:
            break
        waiting.append(published_at)
    return max(0.0, now - min(waiting)) if waiting else 0.0
