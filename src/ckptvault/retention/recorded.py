"""The manager's retention policy, recorded in the store for ``ckptvault gc``.

A manager with ``retention=`` records its policy as a store record (kind
``retention``, one per run) when its keeper first applies it, so that a later
``ckptvault gc STORE --keep-last 3`` keeps what the trainer's policy keeps — its
``keep_best`` winner, its milestones — instead of applying only the rules typed on
the command line.

The record lives in the store, so whoever can write the store can write it. It is
therefore only ever used to keep *more*: ``gc`` keeps a generation when its own rules
*or* the recorded ones keep it (rules compose by union, so adding rules never drops
a generation), and waits the longer of the two delete delays. A forged record can
make gc keep more (cost: space); it cannot make gc delete anything the user's own
rules keep, and a record removed or garbled leaves the user's own rules. Only
``gc --replace-policy`` (shown first, then confirmed) writes a different policy.

The record is bounded and strictly validated when read: canonical JSON within the
store records' limits, exactly the known fields of the right types, the run it names
matching the run gc decides about, and a policy :class:`Retention` accepts. Anything
else is ignored with a warning (gc then applies its own rules only).
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from blake3 import blake3

from ckptvault.errors import CheckpointError, UsageError
from ckptvault.format.layout import format_timestamp
from ckptvault.retention.policy import MAX_SECONDS, Retention
from ckptvault.storage.base import Store

logger = logging.getLogger("ckptvault")

RETENTION_RECORD = "retention"
RECORD_VERSION = 1
_COUNTS = ("keep_last", "keep_every", "keep_best", "keep_hourly", "keep_daily", "keep_weekly")
_SECONDS = ("keep_within", "delete_delay")
_TEXT = ("metric", "mode")
_FIELDS = frozenset((*_COUNTS, *_SECONDS, *_TEXT))
_MAX_RUN_ID = 1024
_MAX_COUNT = 2**63 - 1


def record_name(run_id: str) -> str:
    """The record's name for ``run_id``: a digest, so any run id makes a safe key."""
    return "run-" + blake3(run_id.encode("utf-8")).hexdigest()[:32]


def policy_json(retention: Retention) -> dict[str, Any]:
    """The policy's fields that are set (and the delay), as recorded."""
    fields = {name: getattr(retention, name) for name in (*_COUNTS, "keep_within", "metric")}
    policy = {name: value for name, value in fields.items() if value is not None}
    if retention.keep_best is not None:
        policy["mode"] = retention.mode
    policy["delete_delay"] = retention.delete_delay
    return policy


def record_policy(store: Store, run_id: str, retention: Retention, now: datetime) -> bool:
    """Record ``retention`` as ``run_id``'s policy in ``store``; False (and no write)
    when the same policy is recorded already."""
    if read_policy(store, run_id, quiet=True) == retention:
        return False
    document = {
        "version": RECORD_VERSION,
        "run_id": run_id,
        "policy": policy_json(retention),
        "recorded_at": format_timestamp(now),
    }
    store.put_record(RETENTION_RECORD, record_name(run_id), document)
    return True


def read_policy(store: Store, run_id: str, quiet: bool = False) -> Retention | None:
    """``run_id``'s recorded policy in ``store``, or None when there is none, or it
    cannot be read or is not a valid record (logged as a warning unless ``quiet``)."""
    name = record_name(run_id)
    try:
        found = store.list_records(RETENTION_RECORD, name.__eq__, limit=1)
    except (OSError, CheckpointError) as exc:
        _ignored(store, f"it cannot be read: {exc}", quiet)
        return None
    document = found.get(name)
    if document is None:
        return None
    try:
        return parse_record(document, run_id)
    except UsageError as exc:
        _ignored(store, str(exc), quiet)
        return None


def parse_record(document: dict[str, Any], run_id: str) -> Retention:
    """The policy a record states, validated field by field; UsageError otherwise."""
    if set(document) != {"version", "run_id", "policy", "recorded_at"}:
        raise UsageError(f"unexpected fields {sorted(document)[:8]}")
    if document["version"] != RECORD_VERSION:
        raise UsageError(f"version {str(document['version'])[:20]!r} is not {RECORD_VERSION}")
    recorded_run = document["run_id"]
    if not isinstance(recorded_run, str) or len(recorded_run) > _MAX_RUN_ID:
        raise UsageError("its run id is not a string")
    if recorded_run != run_id:
        raise UsageError("it names another run")
    policy = document["policy"]
    if not isinstance(policy, dict) or not set(policy) <= _FIELDS:
        raise UsageError("its policy has unknown fields")
    for key, value in policy.items():
        if not _well_typed(key, value):
            raise UsageError(f"its policy's {key} is not a valid value")
    return Retention(**policy)


def _well_typed(key: str, value: object) -> bool:
    """Strings of at most 128 characters, integer counts and numbers of seconds within
    bounds (an integer of 400 digits has no float: it is refused here, not later)."""
    if key in _TEXT:
        return isinstance(value, str) and len(value) <= 128
    if isinstance(value, bool):
        return False
    if key in _COUNTS:
        return isinstance(value, int) and 0 < value <= _MAX_COUNT
    return isinstance(value, (int, float)) and 0 <= value <= MAX_SECONDS


def _ignored(store: Store, why: str, quiet: bool) -> None:
    if not quiet:
        logger.warning(
            "the retention policy recorded in %s is ignored (%s): gc applies only the rules "
            "given to it; `ckptvault gc --replace-policy` records a new one",
            store.location,
            why,
        )


def union(given: Retention | None, recorded: Retention | None) -> tuple[tuple[Any, ...], float]:
    """The rules and delete delay gc applies: the union of both policies' rules (a
    generation either keeps is kept) and the longer delay. Either may be None."""
    policies = [p for p in (given, recorded) if p is not None]
    rules = tuple(dict.fromkeys(rule for p in policies for rule in p.rules))  # no repeats
    return rules, max(p.delete_delay for p in policies) if policies else 0.0
