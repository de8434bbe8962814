"""The catalog's tables and the records read back from them.

One SQLite file, versioned by ``schema_version``: a catalog written by a newer
ckptvault (a higher version) is refused rather than misread. Times are Unix epoch
seconds (``time.time()``); durations are wall seconds; stage timings, metrics and the
contract are JSON text. Rows only ever describe what already happened, so a lost
row costs a planner one sample, never a checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

SCHEMA_VERSION = 2  # 2: validations and supervised attempts

TABLES = (
    "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)",
    """CREATE TABLE IF NOT EXISTS generations (
        generation_id TEXT PRIMARY KEY,
        run_id TEXT NOT NULL,
        store TEXT NOT NULL,
        step INTEGER NOT NULL,
        location TEXT NOT NULL,
        bytes INTEGER NOT NULL,
        contract_digest TEXT,
        contract TEXT,
        metrics TEXT,
        published_at REAL NOT NULL,
        validated_at REAL
    )""",
    "CREATE INDEX IF NOT EXISTS generations_by_store ON generations (store, step)",
    """CREATE TABLE IF NOT EXISTS tiers (
        generation_id TEXT NOT NULL,
        tier TEXT NOT NULL,
        location TEXT NOT NULL,
        recorded_at REAL NOT NULL,
        PRIMARY KEY (generation_id, tier)
    )""",
    """CREATE TABLE IF NOT EXISTS saves (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id TEXT NOT NULL,
        store TEXT NOT NULL,
        step INTEGER NOT NULL,
        generation_id TEXT,
        bytes INTEGER NOT NULL,
        seconds REAL NOT NULL,
        stall_seconds REAL NOT NULL,
        stages TEXT NOT NULL,
        finished_at REAL NOT NULL,
        ok INTEGER NOT NULL,
        error_type TEXT,
        error TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS saves_by_time ON saves (finished_at)",
    """CREATE TABLE IF NOT EXISTS restores (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id TEXT NOT NULL,
        store TEXT NOT NULL,
        step INTEGER,
        generation_id TEXT,
        seconds REAL NOT NULL,
        stages TEXT NOT NULL,
        skipped INTEGER NOT NULL,
        finished_at REAL NOT NULL,
        ok INTEGER NOT NULL,
        error_type TEXT,
        error TEXT
    )""",
    "CREATE INDEX IF NOT EXISTS restores_by_time ON restores (finished_at)",
    # Version 2: CREATE IF NOT EXISTS brings version 1 files along on open.
    """CREATE TABLE IF NOT EXISTS attempts (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        supervise_id TEXT NOT NULL,
        attempt INTEGER NOT NULL,
        command TEXT NOT NULL,
        pid INTEGER,
        started_at REAL NOT NULL,
        ended_at REAL NOT NULL,
        exit_code INTEGER,
        signal TEXT,
        decision TEXT NOT NULL,
        kind TEXT NOT NULL,
        reason TEXT NOT NULL
    )""",
    """CREATE TABLE IF NOT EXISTS validations (
        id INTEGER PRIMARY KEY AUTOINCREMENT,
        run_id TEXT NOT NULL,
        store TEXT NOT NULL,
        step INTEGER NOT NULL,
        generation_id TEXT,
        seconds REAL NOT NULL,
        finished_at REAL NOT NULL,
        ok INTEGER NOT NULL,
        error_type TEXT,
        error TEXT
    )""",
)


class Record:
    """Shared by the records: their JSON form (``ckptvault catalog --json``)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]  # every subclass is a dataclass


@dataclass(frozen=True)
class SaveRecord(Record):
    """One save: published (``ok``) or failed after it was accepted (``error``:
    ``"ErrorType: first line"``, ``generation_id`` None, ``bytes`` 0).

    ``seconds``: from ``save()`` being called to the publish (or the failure), a wait
    behind earlier saves included; ``stall_seconds``: how long ``save()`` blocked the
    caller; ``stages``: wall seconds of ``stage`` (asynchronous saves' copy),
    ``write``, ``fsync`` and ``publish``, never adding up to more than ``seconds``
    (a multi-rank save: rank 0's view; its ``publish`` includes agreeing with the other
    ranks). ``finished_at``: Unix time.
    """

    run_id: str
    store: str
    step: int
    generation_id: str | None
    bytes: int
    seconds: float
    stall_seconds: float
    stages: dict[str, float]
    finished_at: float
    ok: bool
    error: str | None


@dataclass(frozen=True)
class RestoreRecord(Record):
    """One restore: applied (``ok``) or refused (``error``, nothing applied).

    ``stages``: wall seconds of ``discovery`` (listing and choosing candidates),
    ``verification`` (manifest, signature and structure checks), ``read`` (reading,
    hashing and decoding the bytes) and ``apply`` (matching and loading into the live
    objects), over every candidate tried; ``skipped``: newer generations it passed over.
    """

    run_id: str
    store: str
    step: int | None
    generation_id: str | None
    seconds: float
    stages: dict[str, float]
    skipped: int
    finished_at: float
    ok: bool
    error: str | None


@dataclass(frozen=True)
class GenerationRecord(Record):
    """A published generation the catalog saw, until a deletion from its store.

    ``tiers``: the store it was published to first, then every tier it was copied
    to; ``contract``: the manifest's contract section (user fields, code revision,
    versions) and ``contract_digest`` its BLAKE3 digest, equal across generations of
    an unchanged contract; ``validated_at``: Unix time of the last successful
    validation, None until one (:meth:`Catalog.mark_validated`).
    """

    run_id: str
    store: str
    step: int
    generation_id: str
    location: str
    tiers: tuple[str, ...]
    bytes: int
    contract_digest: str | None
    contract: dict[str, Any] | None
    metrics: dict[str, float]
    published_at: float
    validated_at: float | None


@dataclass(frozen=True)
class FailureRecord(Record):
    """A failed save (``kind="save"``), a refused restore (``"restore"``) or a failed
    validation (``"validation"``)."""

    kind: str
    run_id: str
    store: str
    step: int | None
    error: str  # the exception's type
    reason: str  # its first line
    seconds: float
    finished_at: float


def dumps(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def loads_object(text: str | None) -> dict[str, Any]:
    """A JSON object column; anything else reads as empty (the catalog is a record
    of what happened, not a trust anchor: a damaged cell costs one sample)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def error_text(error_type: str | None, reason: str | None) -> str | None:
    if error_type is None:
        return None
    return f"{error_type}: {reason}" if reason else error_type
