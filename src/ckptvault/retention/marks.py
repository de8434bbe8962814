"""Deletion marks, pins and leases as the store keeps them (its records).

Every record is named by the generation's directory name (a lease by that name plus
a random suffix, one per reader), so records survive listing order and never need a
manifest. Whoever can write the store can write records too; here that can only
hide a generation from restore (a mark) or keep one from deletion (a pin, a lease),
never make bytes count as verified. Malformed records are skipped.

Records are judged by name before any is read: only names of generations the caller
asks about (or, for marks of generations a store no longer lists and for leases, at
most :data:`~ckptvault.storage.records.MAX_RECORDS_READ` well-formed names), so planted
records cost a listing. Their times are bounded too: a mark dated in the future counts
from now (and is written again with the time of the pass that keeps it marked), and
a lease that claims to run longer than any ckptvault reader's
(:data:`~ckptvault.storage.leases.LEASE_SECONDS` from now) is not honoured.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Iterable
from datetime import datetime, timedelta, timezone
from typing import Any

from ckptvault.errors import UsageError
from ckptvault.format.layout import GenerationName, format_timestamp, parse_generation_dirname
from ckptvault.retention.plan import Mark
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.storage.leases import LEASE_SECONDS
from ckptvault.storage.records import (
    DELETION_MARK,
    LEASE,
    MAX_RECORDS_READ,
    PIN,
    RecordFilter,
)
from ckptvault.storage.retained import RetainingStore

logger = logging.getLogger("ckptvault")

_TIMESTAMP = "%Y-%m-%dT%H:%M:%S.%fZ"
_LEASE_TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
# How far ahead of this machine another host's clock may be: a record dated further
# in the future than that was not written by a ckptvault with a sane clock.
MAX_CLOCK_SKEW = timedelta(minutes=10)


def parse_timestamp(value: object) -> datetime | None:
    """A ckptvault UTC timestamp (``2026-11-29T16:54:23.123456Z``), or None."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.strptime(value, _TIMESTAMP).replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def read_marks(
    store: Store, now: datetime, listed: Collection[GenerationName] | None = None
) -> dict[GenerationName, Mark]:
    """The deletion marks of the ``listed`` generations (without ``listed``: of any
    generation, at most ``MAX_RECORDS_READ``). A mark whose time is unreadable or in
    the future counts from now."""
    if listed is None:
        return _marks(store, now, _generation_record, MAX_RECORDS_READ)
    return _marks(store, now, _one_of(listed), None)


def read_orphan_marks(
    store: Store, now: datetime, listed: Collection[GenerationName]
) -> dict[GenerationName, Mark]:
    """Marks of generations that are not ``listed``, at most ``MAX_RECORDS_READ`` (a
    pass finishes them, so later passes read the rest)."""
    dirnames = {name.dirname for name in listed}

    def orphan(record: str) -> bool:
        return record not in dirnames and _generation_record(record)

    return _marks(store, now, orphan, MAX_RECORDS_READ)


def _marks(
    store: Store, now: datetime, accept: RecordFilter, limit: int | None
) -> dict[GenerationName, Mark]:
    marks = {}
    for name, data in store.list_records(DELETION_MARK, accept, limit).items():
        parsed = parse_generation_dirname(name)
        if parsed is None:
            continue
        reason = data.get("reason")
        reason = reason if isinstance(reason, str) else "marked for deletion"
        marked_at = parse_timestamp(data.get("marked_at"))
        if marked_at is None or marked_at > now + MAX_CLOCK_SKEW:
            marks[parsed] = Mark(now, reason, undated=True)  # unreadable, or not yet
        else:
            marks[parsed] = Mark(min(marked_at, now), reason)
    return marks


def read_pins(
    store: Store, listed: Collection[GenerationName] | None = None
) -> set[GenerationName]:
    """The pinned generations among ``listed`` (without it: any, at most
    ``MAX_RECORDS_READ``)."""
    accept = _one_of(listed) if listed is not None else _generation_record
    limit = None if listed is not None else MAX_RECORDS_READ
    return {
        parsed
        for name in store.list_records(PIN, accept, limit)
        if (parsed := parse_generation_dirname(name)) is not None
    }


def read_leases(
    store: Store, now: datetime, listed: Collection[GenerationName] | None = None
) -> dict[GenerationName, list[datetime]]:
    """Each generation's lease expiry times (expired ones included), of the ``listed``
    generations (without it: of any); at most ``MAX_RECORDS_READ`` leases. A lease
    that claims to run longer than ``LEASE_SECONDS`` from now is left out
    (:func:`lease_expiry`)."""
    dirnames = {name.dirname for name in listed} if listed is not None else None

    def wanted(record: str) -> bool:
        target = _lease_target(record)
        return target is not None and (dirnames is None or target.dirname in dirnames)

    leases: dict[GenerationName, list[datetime]] = {}
    for name, data in store.list_records(LEASE, wanted, MAX_RECORDS_READ).items():
        target = _lease_target(name)
        expires = lease_expiry(data, now, f"{store.location}: lease {name}")
        if target is not None and expires is not None:
            leases.setdefault(target, []).append(expires)
    return leases


def stale_leases(store: Store, now: datetime) -> list[str]:
    """The names of leases that expired, or that no ckptvault reader wrote (too long),
    at most ``MAX_RECORDS_READ`` read."""
    stale = []
    for name, data in store.list_records(LEASE, _lease_record, MAX_RECORDS_READ).items():
        expires = parse_timestamp(data.get("expires_at"))
        if expires is not None and (expires < now or _too_long(expires, now)):
            stale.append(name)
    return stale


def lease_expiry(data: dict[str, Any], now: datetime, where: str) -> datetime | None:
    """When a lease record expires; None when its time is unreadable, or when it claims
    more than ``LEASE_SECONDS`` from now (beyond clock skew): ckptvault never takes
    such a lease, so it is not honoured and cannot keep a generation for ever."""
    expires = parse_timestamp(data.get("expires_at"))
    if expires is None:
        return None
    if _too_long(expires, now):
        logger.warning(
            "%s claims to expire at %s, more than %d hours from now; no ckptvault reader "
            "takes such a lease, so it is not honoured",
            where,
            format_timestamp(expires),
            LEASE_SECONDS // 3600,
        )
        return None
    return expires


def _too_long(expires: datetime, now: datetime) -> bool:
    return expires > now + timedelta(seconds=LEASE_SECONDS) + MAX_CLOCK_SKEW


def _generation_record(record: str) -> bool:
    return parse_generation_dirname(record) is not None


def _one_of(listed: Collection[GenerationName]) -> RecordFilter:
    dirnames = {name.dirname for name in listed}
    return dirnames.__contains__


def _lease_target(record: str) -> GenerationName | None:
    """The generation a lease named ``<generation dir>.<token>`` is on."""
    dirname, _, token = record.rpartition(".")
    if not _LEASE_TOKEN_RE.match(token):
        return None
    return parse_generation_dirname(dirname)


def _lease_record(record: str) -> bool:
    return _lease_target(record) is not None


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
    """Pin every generation of ``step`` (returns the newest): retention never marks or
    deletes them, and a mark one carries is removed by the next retention pass. In a
    store with ``object_lock_days`` their objects are also put under Object Lock
    retention.

    Every one, not only the newest: nothing here can tell a genuine generation from a
    directory planted under the step with a later id, which would otherwise take the
    pin and leave the genuine one to retention, in every tier. A pin only keeps, so
    keeping a planted one too costs space, never a generation."""
    refs = generations_of(store, step)
    for ref in refs:
        record = {"pinned_at": format_timestamp(now), "step": step}
        store.put_record(PIN, ref.name.dirname, record)
        if isinstance(store, RetainingStore):
            store.lock_generation(ref)
    return refs[0]


def unpin(store: Store, step: int) -> list[GenerationRef]:
    """Remove the pins of every generation of ``step``; returns the ones that were pinned."""
    generations = generations_of(store, step)
    pinned = read_pins(store, [ref.name for ref in generations])
    refs = [ref for ref in generations if ref.name in pinned]
    for ref in refs:
        store.delete_record(PIN, ref.name.dirname)
    return refs


def undelete(store: Store, step: int, now: datetime) -> list[GenerationRef]:
    """Remove the deletion marks of ``step``'s generations and pin them, so that the
    next retention pass does not mark them again. Returns those that were marked."""
    generations = generations_of(store, step)
    marks = read_marks(store, now, [ref.name for ref in generations])
    refs = [ref for ref in generations if ref.name in marks]
    for ref in refs:
        store.put_record(PIN, ref.name.dirname, {"pinned_at": format_timestamp(now), "step": step})
        store.delete_record(DELETION_MARK, ref.name.dirname)
    return refs
