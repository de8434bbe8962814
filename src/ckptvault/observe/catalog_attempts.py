"""The catalog's record of supervised attempts: every start of a job under
``ckptvault supervise``, how it ended and what the supervisor decided.

Together with the saves and restores the job itself records, it answers "what
happened to this run overnight": each crash, preemption and restart, in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptvault.errors import CheckpointError
from ckptvault.observe.catalog import Catalog
from ckptvault.observe.catalog_schema import Record


@dataclass(frozen=True)
class AttemptRecord(Record):
    """One start of a supervised job. ``exit_code`` or ``signal`` (the signal that
    killed it) says how it ended; ``decision`` is the supervisor's next move
    (restart, finish, stop, give up, cancel) and ``kind`` its category; ``pid`` is
    None when the start was refused (a preflight) or failed."""

    supervise_id: str
    attempt: int
    command: str
    pid: int | None
    started_at: float
    ended_at: float
    exit_code: int | None
    signal: str | None
    decision: str
    kind: str
    reason: str


_COLUMNS = (
    "supervise_id, attempt, command, pid, started_at, ended_at, exit_code, signal, "
    "decision, kind, reason"
)


def record_attempt(catalog: Catalog, attempt: AttemptRecord) -> None:
    with catalog.transaction() as db:
        db.execute(
            f"INSERT INTO attempts ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                attempt.supervise_id,
                attempt.attempt,
                attempt.command,
                attempt.pid,
                attempt.started_at,
                attempt.ended_at,
                attempt.exit_code,
                attempt.signal,
                attempt.decision,
                attempt.kind,
                attempt.reason,
            ),
        )


def recent_attempts(
    catalog: Catalog, supervise_id: str | None = None, limit: int = 50
) -> list[AttemptRecord]:
    """The newest ``limit`` attempts (of one supervise run), oldest first."""
    where, parameters = ("WHERE supervise_id = ?", [supervise_id]) if supervise_id else ("", [])
    rows = catalog.query(
        f"SELECT {_COLUMNS} FROM attempts {where} ORDER BY id DESC LIMIT ?",
        [*parameters, max(0, limit)],
    )
    return [
        AttemptRecord(
            supervise_id=str(r[0]),
            attempt=int(r[1]),
            command=str(r[2]),
            pid=None if r[3] is None else int(r[3]),
            started_at=float(r[4]),
            ended_at=float(r[5]),
            exit_code=None if r[6] is None else int(r[6]),
            signal=r[7],
            decision=str(r[8]),
            kind=str(r[9]),
            reason=str(r[10]),
        )
        for r in reversed(rows)
    ]


def attempt_recorder(path: Path, warn: Callable[[str], None]) -> Callable[[dict[str, Any]], None]:
    """A ``Supervisor.record`` hook that writes each attempt to the catalog at
    ``path``; a catalog that cannot be written is reported through ``warn`` and never
    stops the supervision (the catalog is a record, not a control)."""

    def record(entry: dict[str, Any]) -> None:
        if entry.get("event") != "attempt":
            return
        attempt = AttemptRecord(
            supervise_id=str(entry["supervise_id"]),
            attempt=int(entry["attempt"]),
            command=str(entry.get("command", "")),
            pid=entry.get("pid"),
            started_at=float(entry["started_at"]),
            ended_at=float(entry["ended_at"]),
            exit_code=entry.get("exit_code"),
            signal=entry.get("signal"),
            decision=str(entry["decision"]),
            kind=str(entry["kind"]),
            reason=str(entry.get("reason") or entry.get("refused") or ""),
        )
        try:
            with Catalog(path) as catalog:
                record_attempt(catalog, attempt)
        except CheckpointError as exc:
            warn(f"attempt {attempt.attempt} could not be recorded in the catalog {path}: {exc}")

    return record
