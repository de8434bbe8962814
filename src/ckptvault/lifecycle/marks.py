"""Deletion marks, pins and leases as the store keeps them (its records).

Every record is named by the generation's directory name (a lease by that name plus
a random suffix, one per reader), so records survive listing order and never need a
manifest. Whoever can write the store can write records too; here that can only
hide a generation from restore (a mark) or keep one from deletion (a pin, a lease),
never make bytes count as verified. Malformed records are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timezone

from ckptvault.errors import UsageError
from ckptvault.format.layout import GenerationName, format_timestamp, parse_generation_dirname
from ckptvault.lifecycle.plan import Mark
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.storage.records import DELETION_MARK, LEASE, PIN
from ckptvault.storage.retained import RetainingStore

_TIMESTAMP = "%Y-%m-%dT%H:%M:%S.%fZ"


def parse_timestamp(value: object) -> datetime | None:
    """A ckptvault UTC timestamp (``2026-11-29T16:54:23.123456Z``), or None."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.strptime(value, _TIMESTAMP).replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def read_marks(store: Store, now: datetime) -> dict[GenerationName, Mark]:
    """Every deletion mark by generation; a mark whose time is unreadable counts from now."""
    marks = {}
    for name, data in store.list_records(DELETION_MARK).items():
        parsed = parse_generation_dirname(name)
        if parsed is None:
            continue
        reason = data.get("reason")
        marks[parsed] = Mark(
            parse_timestamp(data.get("marked_at")) or now,
            reason if isinstance(reason, str) else "marked for deletion",
        )
    return marks


def read_pins(store: Store) -> set[GenerationName]:
    return {
        parsed
        for name in store.list_records(PIN)
        if (parsed := parse_generation_dirname(name)) is not None
    }


def read_leases(store: Store) -> dict[GenerationName, list[datetime]]:
    """Each generation's lease expiry times (expired ones included)."""
    leases: dict[GenerationName, list[datetime]] = {}
    for name, data in store.list_records(LEASE).items():
        parsed = parse_generation_dirname(name.rsplit(".", 1)[0])
        expires = parse_timestamp(data.get("expires_at"))
        if parsed is not None and expires is not None:
            leases.setdefault(parsed, []).append(expires)
    return leases


def put_mark(stores: Iterable[Store], name: GenerationName, reason: str, now: datetime) -> None:
    record = {"marked_at": format_timestamp(now), "reason": reason}
    for store in stores:
        store.put_record(DELETION_MARK, name.dirname, record)


def remove_mark(stores: Iterable[Store], name: GenerationName) -> None:
    for store in stores:
        store.delete_record(DELETION_MARK, name.dirname)


def generations_of(store: Store, step: int) -> list[GenerationRef]:
    """The generations of ``step``, newest first (marked ones included)."""
    refs = [ref for ref in store.list_generations() if ref.step == step]
    if not refs:
        raise UsageError(
            f"store {store.location} has no generation of step {step} (a deleted generation "
            "cannot be brought back; undelete works only while it is marked)"
        )
    return refs


def pin(store: Store, step: int, now: datetime) -> GenerationRef:
    """Pin the newest generation of ``step``: retention never marks or deletes it, and
    a mark it carries is removed by the next retention pass. In a store with
    ``object_lock_days`` its objects are also put under Object Lock retention."""
    ref = generations_of(store, step)[0]
    store.put_record(PIN, ref.name.dirname, {"pinned_at": format_timestamp(now), "step": step})
    if isinstance(store, RetainingStore):
        store.lock_generation(ref)
    return ref


def unpin(store: Store, step: int) -> list[GenerationRef]:
    """Remove the pins of every generation of ``step``; returns the ones that were pinned."""
    pinned = read_pins(store)
    refs = [ref for ref in generations_of(store, step) if ref.name in pinned]
    for ref in refs:
        store.delete_record(PIN, ref.name.dirname)
    return refs


def undelete(store: Store, step: int, now: datetime) -> list[GenerationRef]:
    """Remove the deletion marks of ``step``'s generations and pin them, so that the
    next retention pass does not mark them again. Returns those that were marked."""
    marks = read_marks(store, now)
    refs = [ref for ref in generations_of(store, step) if ref.name in marks]
    for ref in refs:
        store.put_record(PIN, ref.name.dirname, {"pinned_at": format_timestamp(now), "step": step})
        store.delete_record(DELETION_MARK, ref.name.dirname)
    return refs
