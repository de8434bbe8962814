"""The rollback ledger: per run, the highest step ever restored — kept outside the store.

A validly signed old checkpoint is still a valid signature: an attacker who can
choose what a run restores could roll it back to before a fix without forging
anything. The ledger records, per run id, the highest step restored (the restore
*floor*) and, for every allowed rollback, a *rule*: every generation of the run with
a step above the new floor created before the rollback (generation id below the
rule's cutoff id) is abandoned. A rule, not only a list of what was visible then:
a newer generation hidden from the store during the rollback and put back later is
still abandoned. (The generations seen at the time are listed too, for reporting.)
Restore skips generations below the floor or abandoned. Because whoever can write the
checkpoint store must not be able to lower the floor, the ledger lives elsewhere:
by default in the per-user state directory (``$XDG_STATE_HOME/ckptvault`` or
``~/.local/state/ckptvault``).

It also keeps the head (entry count and last hash) of each audit log, so that a
truncated log is detected, and the append in progress, so that one a crash cut short
is not mistaken for tampering. Storage is SQLite from the standard library; every
operation is one short transaction, safe across processes.
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ckptvault.format.layout import new_generation_id
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
CREATE TABLE IF NOT EXISTS rollbacks (
    run_id TEXT NOT NULL,
    floor_step INTEGER NOT NULL,
    cutoff_generation_id TEXT NOT NULL,
    created_at TEXT NOT NULL,
    PRIMARY KEY (run_id, cutoff_generation_id)
);
CREATE TABLE IF NOT EXISTS published (
    run_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    generation_id TEXT NOT NULL,
    published_at TEXT NOT NULL,
    PRIMARY KEY (run_id, generation_id)
);
CREATE TABLE IF NOT EXISTS marked (
    run_id TEXT NOT NULL,
    generation_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    marked_at TEXT NOT NULL,
    PRIMARY KEY (run_id, generation_id)
);
CREATE TABLE IF NOT EXISTS audit_heads (
    log_path TEXT PRIMARY KEY,
    entries INTEGER NOT NULL,
    last_hash TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS audit_pending (
    log_path TEXT PRIMARY KEY,
    size_before INTEGER NOT NULL,
    size_after INTEGER NOT NULL,
    entries INTEGER NOT NULL,
    last_hash TEXT NOT NULL
);
"""


PUBLISHED_KEPT = 16  # publishes remembered per run


def default_state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(
        os.path.expanduser("~"), ".local", "state"
    )
    return Path(base) / "ckptvault"


def default_ledger_path() -> Path:
    return default_state_dir() / "ledger.sqlite3"


@dataclass(frozen=True)
class PendingAppend:
    """An audit append the ledger was told of before its bytes were written: the log's
    size before and after it, and the head after it. Left behind, it tells the next
    append (and ``audit verify``) that a crash cut that append short
    (``ckptvault.trust.audit``)."""

    size_before: int
    size_after: int
    entries: int
    last_hash: str


@dataclass(frozen=True, order=True)
class RollbackRule:
    """One allowed rollback: every generation with a step above ``floor_step`` whose
    id sorts before ``cutoff`` (created before the rollback) is abandoned."""

    cutoff: str  # a generation id made at the rollback; later saves sort after it
    floor_step: int
    created_at: str

    def abandons(self, step: int, generation_id: str) -> bool:
        return step > self.floor_step and generation_id < self.cutoff


@dataclass(frozen=True)
class RestoreFloor:
    """What a run may restore: nothing below ``step``, nothing in ``abandoned``, nothing
    a rollback ``rules`` abandoned (oldest rule first).

    ``abandoned`` holds ``(generation id, step)`` pairs, matched together: the list is
    what the store listed at a rollback, and a name planted there (a directory of a huge
    step under the id of the very generation rolled back to) must not abandon the
    genuine generation of that id at its own step."""

    run_id: str
    step: int | None = None
    generation_id: str | None = None
    abandoned: frozenset[tuple[str, int]] = field(default_factory=frozenset)
    rules: tuple[RollbackRule, ...] = ()

    @property
    def newest_cutoff(self) -> str | None:
        """The cutoff of the run's latest rollback: new generation ids must sort after it."""
        return max((rule.cutoff for rule in self.rules), default=None)

    def without_step(self) -> RestoreFloor:
        """Only what rollbacks abandoned: for reading below the floor on purpose."""
        return RestoreFloor(self.run_id, abandoned=self.abandoned, rules=self.rules)

    def refuses(self, step: int, generation_id: str) -> str | None:
        """The rollback reason for this generation, or None when it is allowed."""
        if (generation_id, step) in self.abandoned:
            return (
                f"generation {generation_id} (step {step}) was abandoned by an allowed rollback "
                "and is never restored again"
            )
        for rule in self.rules:
            if rule.abandons(step, generation_id):
                return (
                    f"generation {generation_id} (step {step}) was abandoned by the rollback to "
                    f"step {rule.floor_step} at {rule.created_at}: it was created before that "
                    "rollback, above its step, and is never restored again (a generation hidden "
                    "during the rollback and put back counts too). Save a new generation"
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


def rollback_cutoff(
    previous: RestoreFloor | None, restored_generation_id: str, published: Iterable[str] = ()
) -> str:
    """The cutoff id for an allowed rollback made now.

    It sorts after everything of the run the ledger vouches for — the generation
    rolled back to, the previous floor's generation, earlier cutoffs, the publishes it
    recorded (``published``) — even when this machine's clock is behind the one that
    wrote them: a newer generation saved on a node whose clock ran ahead, hidden during
    the rollback and put back, is abandoned too. (Ids merely listed in the store are
    not used: whoever can write the store could plant one far in the future.)
    """
    known = [restored_generation_id, *published]
    if previous is not None:
        known += [g for g in (previous.generation_id, previous.newest_cutoff) if g is not None]
    return new_generation_id(not_before=max(known))


class Ledger:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(os.path.abspath(os.fspath(path)))

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # Owner-only from the start (sqlite3 would create it with the umask's mode).
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
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
                (str(g), int(s))
                for g, s in db.execute(
                    "SELECT generation_id, step FROM abandoned WHERE run_id = ?", (run_id,)
                )
            }
            rules = tuple(
                sorted(
                    RollbackRule(str(cutoff), int(floor_step), str(created_at))
                    for cutoff, floor_step, created_at in db.execute(
                        "SELECT cutoff_generation_id, floor_step, created_at FROM rollbacks "
                        "WHERE run_id = ?",
                        (run_id,),
                    )
                )
            )
        if row is None:
            return RestoreFloor(run_id, abandoned=frozenset(abandoned), rules=rules)
        return RestoreFloor(run_id, int(row[0]), str(row[1]), frozenset(abandoned), rules)

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
        self,
        run_id: str,
        step: int,
        generation_id: str,
        abandoned: Iterable[tuple[str, int]],
        cutoff_generation_id: str,
    ) -> None:
        """An allowed rollback: set the floor to ``step``, record the rule that abandons
        every generation above ``step`` with an id below ``cutoff_generation_id``, and
        list ``abandoned`` (what was seen at the time)."""
        now = _now()
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO floors VALUES (?, ?, ?, ?)",
                (run_id, step, generation_id, now),
            )
            db.execute(
                "INSERT OR IGNORE INTO rollbacks VALUES (?, ?, ?, ?)",
                (run_id, step, cutoff_generation_id, now),
            )
            db.executemany(
                "INSERT OR IGNORE INTO abandoned VALUES (?, ?, ?, ?)",
                [(run_id, gen, gen_step, now) for gen, gen_step in abandoned],
            )

    def record_published(self, run_id: str, step: int, generation_id: str) -> None:
        """Remember a publish, so that its later disappearance from the store is seen.
        Only the newest :data:`PUBLISHED_KEPT` per run are kept: recovery only ever
        cares about the newest few."""
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO published VALUES (?, ?, ?, ?)",
                (run_id, step, generation_id, _now()),
            )
            db.execute(
                "DELETE FROM published WHERE run_id = ? AND generation_id NOT IN (SELECT "
                "generation_id FROM published WHERE run_id = ? ORDER BY step DESC, "
                "generation_id DESC LIMIT ?)",
                (run_id, run_id, PUBLISHED_KEPT),
            )

    def forget_published(self, run_id: str, generation_id: str) -> None:
        """A generation deleted on purpose (retention) is not missing."""
        with self._connect() as db:
            db.execute(
                "DELETE FROM published WHERE run_id = ? AND generation_id = ?",
                (run_id, generation_id),
            )

    def published(self, run_id: str) -> list[tuple[int, str]]:
        """``(step, generation id)`` of the run's newest recorded publishes, newest first."""
        with self._connect() as db:
            rows = db.execute(
                "SELECT step, generation_id FROM published WHERE run_id = ? "
                "ORDER BY step DESC, generation_id DESC",
                (run_id,),
            ).fetchall()
        return [(int(step), str(generation_id)) for step, generation_id in rows]

    def record_mark(self, run_id: str, step: int, generation_id: str) -> None:
        """Retention marked this generation for deletion (this ledger's own record,
        so that a mark planted in the store is told apart from one ckptvault made)."""
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO marked VALUES (?, ?, ?, ?)",
                (run_id, generation_id, step, _now()),
            )

    def forget_mark(self, run_id: str, generation_id: str) -> None:
        with self._connect() as db:
            db.execute(
                "DELETE FROM marked WHERE run_id = ? AND generation_id = ?", (run_id, generation_id)
            )

    def marks(self, run_id: str) -> set[tuple[int, str]]:
        """``(step, generation id)`` of every mark ckptvault recorded for the run."""
        with self._connect() as db:
            rows = db.execute(
                "SELECT step, generation_id FROM marked WHERE run_id = ?", (run_id,)
            ).fetchall()
        return {(int(step), str(generation_id)) for step, generation_id in rows}

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

    def has_audit_heads(self) -> bool:
        """Whether the ledger keeps the head of any audit log at all (a fresh ledger
        does not: it cannot tell a log it never saw from one it lost)."""
        with self._connect() as db:
            return db.execute("SELECT 1 FROM audit_heads LIMIT 1").fetchone() is not None

    def set_audit_head(self, log_path: str, entries: int, last_hash: str) -> None:
        """Record the log's new head; the append it ends is no longer pending."""
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO audit_heads VALUES (?, ?, ?)",
                (log_path, entries, last_hash),
            )
            db.execute("DELETE FROM audit_pending WHERE log_path = ?", (log_path,))

    def begin_audit_append(self, log_path: str, append: PendingAppend) -> None:
        """Record an append about to be written (before its bytes reach the log)."""
        with self._connect() as db:
            db.execute(
                "INSERT OR REPLACE INTO audit_pending VALUES (?, ?, ?, ?, ?)",
                (log_path, append.size_before, append.size_after, append.entries, append.last_hash),
            )

    def audit_pending(self, log_path: str) -> PendingAppend | None:
        with self._connect() as db:
            row = db.execute(
                "SELECT size_before, size_after, entries, last_hash FROM audit_pending "
                "WHERE log_path = ?",
                (log_path,),
            ).fetchone()
        if row is None:
            return None
        return PendingAppend(int(row[0]), int(row[1]), int(row[2]), str(row[3]))

    def forget_audit_append(self, log_path: str) -> None:
        with self._connect() as db:
            db.execute("DELETE FROM audit_pending WHERE log_path = ?", (log_path,))
