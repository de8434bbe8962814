"""The rollback ledger: per run, the highest step ever restored — kept outside the store.

A validly signed old checkpoint is still a valid signature: an attacker who can
choose what a run restores could roll it back to before a fix without forging
anything. The ledger records, per run id, the highest step restored (the restore
*floor*) and the generations explicitly abandoned by an allowed rollback; restore
skips generations below the floor or abandoned. Because whoever can write the
checkpoint store must not be able to lower the floor, the ledger lives elsewhere:
by default in the per-user state directory (``$XDG_STATE_HOME/ckptvault`` or
``~/.local/state/ckptvault``).

It also keeps the head (entry count and last hash) of each audit log, so that a
truncated log is detected. Storage is SQLite from the standard library; every
operation is one short transaction, safe across processes.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ckptvault.format.layout import utc_now as _now

_SCHEMA = """
CREATE TABLE IF NOT EXISTS floors (
    run_id TEXT PRIMARY KEY,
    step INTEGER NOT NULL,
    generation_id TEXT NOT NULL,
    updated_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS abandoned (
    run_id TEXT NOT NULL,
    generation_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    abandoned_at TEXT NOT NULL,
    PRIMARY KEY (run_id, generation_id)
);
CREATE TABLE IF NOT EXISTS audit_heads (
    log_path TEXT PRIMARY KEY,
    entries INTEGER NOT NULL,
    last_hash TEXT NOT NULL
);
"""


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return Path(base) / "ckptvault"


def default_ledger_path() -> Path:
    return default_state_dir() / "ledger.sqlite3"


@dataclass(frozen=True)
class RestoreFloor:
    """What a run may restore: nothing below ``step``, nothing in ``abandoned``."""

    run_id: str
    step: int | None = None
    generation_id: str | None = None
    abandoned: frozenset[str] = field(default_factory=frozenset)

    def refuses(self, step: int, generation_id: str) -> str | None:
        """The rollback reason for this generation, or None when it is allowed."""
        if generation_id in self.abandoned:
            return (
                f"generation {generation_id} (step {step}) was abandoned by an allowed rollback "
                "and is never restored again"
            )
        if self.step is not None and step < self.step:
            return (
                f"step {step} is below the restore floor {self.step} (generation "
                f"{self.generation_id} was restored before): refusing to roll back"
            )
        if (
            self.step is not None
            and step == self.step
            and self.generation_id is not None
            and generation_id < self.generation_id
        ):
            # Generation ids sort by creation time: an older save of the floor's step.
            return (
                f"generation {generation_id} is an older save of step {step} than "
                f"{self.generation_id}, which was restored before: refusing to roll back"
            )
        return None


class Ledger:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(os.path.abspath(os.fspath(path)))

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        connection = sqlite3.connect(self.path, timeout=60, isolation_level=None)
        try:
            connection.execute("PRAGMA synchronous=FULL")
            connection.executescript(_SCHEMA)
            connection.execute("BEGIN IMMEDIATE")
            try:
                yield connection
            except BaseException:
                connection.execute("ROLLBACK")
                raise
            connection.execute("COMMIT")
        finally:
            connection.close()

    def floor(self, run_id: str) -> RestoreFloor:
        with self._connect() as db:
            row = db.execute(
                "SELECT step, generation_id FROM floors WHERE run_id = ?", (run_id,)
            ).fetchone()
            abandoned = {
                g
                for (g,) in db.execute(
                    "SELECT generation_id FROM abandoned WHERE run_id = ?", (run_id,)
                )
            }
        if row is None:
            return RestoreFloor(run_id, abandoned=frozenset(abandoned))
        return RestoreFloor(run_id, int(row[0]), str(row[1]), frozenset(abandoned))

    def record_restore(self, run_id: str, step: int, generation_id: str) -> None:
        """Raise the floor to ``step`` (never lowers it)."""
        with self._connect() as db:
            row = db.execute("SELECT step FROM floors WHERE run_id = ?", (run_id,)).fetchone()
            if row is None or step >= int(row[0]):
                db.execute(
                    "INSERT OR REPLACE INTO floors VALUES (?, ?, ?, ?)",
                    (run_id, step, generation_id, _now()),
                )

    def lower_floor(
        self, run_id: str, step: int, generation_id: str, abandoned: Iterable[tuple[str, int]]
    ) -> None:
        """An allowed rollback: set the floor to ``step`` and abandon ``abandoned``."""
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO floors VALUES (?, ?, ?, ?)",
                (run_id, step, generation_id, _now()),
            )
            db.executemany(
                "INSERT OR IGNORE INTO abandoned VALUES (?, ?, ?, ?)",
                [(run_id, gen, gen_step, _now()) for gen, gen_step in abandoned],
            )

    def abandoned(self, run_id: str) -> list[tuple[str, int]]:
        with self._connect() as db:
            rows = db.execute(
                "SELECT generation_id, step FROM abandoned WHERE run_id = ? ORDER BY step",
                (run_id,),
            ).fetchall()
        return [(str(g), int(s)) for g, s in rows]

    def audit_head(self, log_path: str) -> tuple[int, str] | None:
        with self._connect() as db:
            row = db.execute(
                "SELECT entries, last_hash FROM audit_heads WHERE log_path = ?", (log_path,)
            ).fetchone()
        return (int(row[0]), str(row[1])) if row else None

    def set_audit_head(self, log_path: str, entries: int, last_hash: str) -> None:
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO audit_heads VALUES (?, ?, ?)",
                (log_path, entries, last_hash),
            )
