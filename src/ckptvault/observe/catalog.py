"""The catalog: what a run's checkpoints cost and where they are, in one SQLite file.

It records every published generation (step, id, tiers, bytes, contract, metrics,
published and validated times), every save with its duration split into stages
(``stage``, ``write``, ``fsync``, ``publish``) and how long it blocked training,
every restore split into ``discovery``, ``verification``, ``read`` and ``apply``, and
the failures: saves that failed after they were accepted, restores that were refused.
The cadence planner, ``status`` and drills read it; ``ckptvault catalog`` shows it.

It is written by an event subscriber (:mod:`ckptvault.observe.catalog_recorder`),
never by the save or restore path itself, and lives in the control-plane state
directory beside the rollback ledger (:func:`default_catalog_path`), never in the
store. Several processes may write it at once (the trainer, ``ckptvault``
commands); each event is one short transaction (:mod:`.catalog_db`: WAL, a busy
timeout, a private file, a schema version).
"""

from __future__ import annotations

import logging
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from blake3 import blake3

from ckptvault.errors import CheckpointError
from ckptvault.events import (
    Deleted,
    Event,
    MemorySkipped,
    Published,
    Refused,
    Replicated,
    Restored,
    SaveFailed,
    Validated,
)
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.layout import GenerationName
from ckptvault.observe.catalog_db import CatalogFile
from ckptvault.observe.catalog_schema import (
    FailureRecord,
    GenerationRecord,
    RestoreRecord,
    SaveRecord,
    dumps,
    error_text,
    loads_object,
)
from ckptvault.storage.locations import canonical_location

__all__ = [
    "Catalog",
    "FailureRecord",
    "GenerationRecord",
    "RestoreRecord",
    "SaveRecord",
    "default_catalog_path",
    "store_key",
]

CATALOG_NAME = "catalog.sqlite3"


logger = logging.getLogger("ckptvault")


def default_catalog_path(ledger_path: Path) -> Path:
    """The catalog beside the rollback ledger: ``<ledger's directory>/catalog.sqlite3``."""
    return Path(os.path.abspath(os.fspath(ledger_path))).parent / CATALOG_NAME


def validated_generations(path: Path | None, run_id: str | None) -> frozenset[GenerationName]:
    """The generations (step and id) of ``run_id`` (any run: None) the catalog at
    ``path`` has seen validated; empty when there is no catalog or it cannot be read
    (retention then simply has no validated generation to spare). A generation is
    known by its name, never by its id alone: a directory planted under another step
    with a validated generation's id is another generation, and must not take the
    protection of the one that was validated."""
    if path is None or not path.is_file():
        return frozenset()
    try:
        with Catalog(path) as catalog:
            where, parameters = ("WHERE run_id = ? AND", [run_id]) if run_id else ("WHERE", [])
            rows = catalog.query(
                f"SELECT step, generation_id FROM generations {where} validated_at IS NOT NULL",
                parameters,
            )
    except CheckpointError as exc:
        logger.warning("cannot read validated generations from %s: %s", path, exc)
        return frozenset()
    return frozenset(GenerationName(int(row[0]), str(row[1])) for row in rows)


def store_key(location: str | os.PathLike[str]) -> str:
    """A store as the catalog names it (the manager's ``store.location``): a local
    path or ``file://`` URL made absolute, an ``s3://`` or ``az://`` URL in its canonical form. For
    the ``store=`` filters of the readers, given what a user typed."""
    return canonical_location(location)


def _epoch(when: float | datetime) -> float:
    return when.timestamp() if isinstance(when, datetime) else float(when)


class Catalog(CatalogFile):
    """An open catalog file (created with its tables when missing): the events it
    records, and the records read back. Raises
    :class:`~ckptvault.errors.CatalogError` when it cannot be opened, read or written.
    Use it as a context manager, or call :meth:`close`; threads may share one.
    """

    def __enter__(self) -> Catalog:
        return self

    # -- writing: one event, one transaction -------------------------------------------

    def record(self, event: Event, when: float | None = None) -> None:
        """Record what ``event`` says happened (at ``when``, Unix time; default now).
        Events the catalog does not keep (marks, replica disagreements) are ignored."""
        at = time.time() if when is None else when
        if isinstance(event, Published):
            self._published(event, at)
        elif isinstance(event, SaveFailed):
            with self.transaction() as db:
                db.execute(_INSERT_SAVE, _save_row(event, at))
        elif isinstance(event, MemorySkipped):  # an attempt the memory tier had no room for
            row = (event.run_id, event.store, event.step, None, 0, 0.0, 0.0, "{}", at, 0)
            with self.transaction() as db:
                db.execute(_INSERT_SAVE, (*row, "MemorySkipped", event.reason))
        elif isinstance(event, (Restored, Refused)):
            with self.transaction() as db:
                db.execute(_INSERT_RESTORE, _restore_row(event, at))
        elif isinstance(event, Replicated):
            with self.transaction() as db:  # a copy of a generation the catalog knows
                db.execute(
                    "INSERT OR REPLACE INTO tiers (generation_id, tier, location, recorded_at) "
                    "SELECT ?, ?, ?, ? WHERE EXISTS "
                    "(SELECT 1 FROM generations WHERE generation_id = ?)",
                    (event.generation_id, event.target, event.location, at, event.generation_id),
                )
        elif isinstance(event, Deleted):
            self._deleted(event)
        elif isinstance(event, Validated):
            self._validated(event, at)

    def _validated(self, event: Validated, at: float) -> None:
        """A validation: its row; a success also stamps the generation (recorded now
        if the catalog had not seen it published, e.g. by another process)."""
        with self.transaction() as db:
            db.execute(
                "INSERT INTO validations (run_id, store, step, generation_id, seconds, "
                "finished_at, ok, error_type, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (event.run_id, event.store, event.step, event.generation_id, event.seconds, at,
                 int(event.ok), event.error, event.reason),
            )  # fmt: skip
            if event.ok and event.generation_id is not None:
                db.execute(
                    "INSERT OR IGNORE INTO generations (generation_id, run_id, store, step, "
                    "location, bytes, published_at) VALUES (?, ?, ?, ?, ?, 0, ?)",
                    (event.generation_id, event.run_id, event.store, event.step, event.store, at),
                )
                db.execute(
                    "UPDATE generations SET validated_at = ? WHERE generation_id = ?",
                    (at, event.generation_id),
                )

    def _published(self, event: Published, at: float) -> None:
        contract, digest = None, None
        if event.contract is not None:
            raw = dumps_canonical(dict(event.contract))
            contract, digest = raw.decode("utf-8"), blake3(raw).hexdigest()
        metrics = dumps(dict(event.metrics)) if event.metrics else None
        with self.transaction() as db:
            db.execute(
                "INSERT OR REPLACE INTO generations (generation_id, run_id, store, step, "
                "location, bytes, contract_digest, contract, metrics, published_at, "
                "validated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, (SELECT validated_at "
                "FROM generations WHERE generation_id = ?))",
                (
                    event.generation_id,
                    event.run_id,
                    event.store,
                    event.step,
                    event.location,
                    event.bytes,
                    digest,
                    contract,
                    metrics,
                    at,
                    event.generation_id,
                ),
            )
            db.execute(
                "INSERT OR REPLACE INTO tiers (generation_id, tier, location, recorded_at) "
                "VALUES (?, ?, ?, ?)",
                (event.generation_id, event.store, event.location, at),
            )
            db.execute(_INSERT_SAVE, _save_row(event, at))

    def _deleted(self, event: Deleted) -> None:
        """A deletion from the store a generation was published to ends its record
        (retention there also decides for the tiers it covers); one from another tier
        only drops that tier. The deletion of another step's generation under a known id
        (a directory planted with it) touches nothing: the record, its tiers and its
        validation stamp are the genuine generation's."""
        with self.transaction() as db:
            home = db.execute(
                "SELECT store, step FROM generations WHERE generation_id = ?",
                (event.generation_id,),
            ).fetchone()
            if home is not None and int(home[1]) != event.step:
                return
            db.execute(
                "DELETE FROM tiers WHERE generation_id = ? AND tier = ?",
                (event.generation_id, event.store),
            )
            if home is not None and home[0] == event.store:
                db.execute("DELETE FROM tiers WHERE generation_id = ?", (event.generation_id,))
                db.execute(
                    "DELETE FROM generations WHERE generation_id = ?", (event.generation_id,)
                )

    def mark_validated(self, generation_id: str, when: float | datetime) -> bool:
        """Record that ``generation_id`` was loaded and checked successfully at
        ``when`` (Unix time or an aware datetime); False when the catalog does not
        know the generation (then nothing is recorded)."""
        with self.transaction() as db:
            cursor = db.execute(
                "UPDATE generations SET validated_at = ? WHERE generation_id = ?",
                (_epoch(when), generation_id),
            )
            return cursor.rowcount > 0

    # -- reading ---------------------------------------------------------------------

    @staticmethod
    def _where(store: str | None, run_id: str | None, prefix: str = "") -> tuple[str, list[Any]]:
        clauses, parameters = [], []
        for column, value in (("store", store), ("run_id", run_id)):
            if value is not None:
                clauses.append(f"{prefix}{column} = ?")
                parameters.append(value)
        return (" WHERE " + " AND ".join(clauses) if clauses else ""), parameters

    def stores(self, limit: int = 100) -> list[str]:
        """The stores the catalog holds any save, restore, validation or generation
        of (as the manager names them), sorted; at most ``limit``."""
        rows = self.query(
            "SELECT store FROM saves UNION SELECT store FROM restores UNION "
            "SELECT store FROM validations UNION SELECT store FROM generations "
            "ORDER BY store LIMIT ?",
            [max(0, limit)],
        )
        return [str(row[0]) for row in rows]

    def recent_saves(
        self, store: str | None = None, run_id: str | None = None, limit: int = 50
    ) -> list[SaveRecord]:
        """The newest ``limit`` saves (failed ones too, ``ok=False``), newest first;
        ``store`` is a store location as the manager names it (an absolute path or URL)."""
        where, parameters = self._where(store, run_id)
        rows = self.query(
            "SELECT run_id, store, step, generation_id, bytes, seconds, stall_seconds, "
            f"stages, finished_at, ok, error_type, error FROM saves{where} "
            "ORDER BY finished_at DESC, id DESC LIMIT ?",
            [*parameters, max(0, limit)],
        )
        return [
            SaveRecord(
                run_id=r[0],
                store=r[1],
                step=int(r[2]),
                generation_id=r[3],
                bytes=int(r[4]),
                seconds=float(r[5]),
                stall_seconds=float(r[6]),
                stages={k: float(v) for k, v in loads_object(r[7]).items()},
                finished_at=float(r[8]),
                ok=bool(r[9]),
                error=error_text(r[10], r[11]),
            )
            for r in rows
        ]

    def recent_restores(
        self, store: str | None = None, run_id: str | None = None, limit: int = 50
    ) -> list[RestoreRecord]:
        """The newest ``limit`` restores (refused ones too, ``ok=False``), newest first."""
        where, parameters = self._where(store, run_id)
        rows = self.query(
            "SELECT run_id, store, step, generation_id, seconds, stages, skipped, "
            f"finished_at, ok, error_type, error FROM restores{where} "
            "ORDER BY finished_at DESC, id DESC LIMIT ?",
            [*parameters, max(0, limit)],
        )
        return [
            RestoreRecord(
                run_id=r[0],
                store=r[1],
                step=None if r[2] is None else int(r[2]),
                generation_id=r[3],
                seconds=float(r[4]),
                stages={k: float(v) for k, v in loads_object(r[5]).items()},
                skipped=int(r[6]),
                finished_at=float(r[7]),
                ok=bool(r[8]),
                error=error_text(r[9], r[10]),
            )
            for r in rows
        ]

    def generations(
        self, store: str | None = None, run_id: str | None = None
    ) -> list[GenerationRecord]:
        """Generations published and not deleted since, newest step first."""
        where, parameters = self._where(store, run_id, "g.")
        rows = self.query(
            "SELECT g.run_id, g.store, g.step, g.generation_id, g.location, g.bytes, "
            "g.contract_digest, g.contract, g.metrics, g.published_at, g.validated_at, t.tier "
            f"FROM generations g LEFT JOIN tiers t ON t.generation_id = g.generation_id{where} "
            "ORDER BY g.step DESC, g.generation_id DESC, t.tier != g.store, t.recorded_at",
            parameters,
        )
        tiers: dict[str, list[str]] = {}
        firsts = []
        for row in rows:  # one row per tier: the home store's first
            if row[3] not in tiers:
                tiers[row[3]] = []
                firsts.append(row)
            if row[11] is not None:
                tiers[row[3]].append(row[11])
        return [
            GenerationRecord(
                run_id=r[0],
                store=r[1],
                step=int(r[2]),
                generation_id=r[3],
                location=r[4],
                tiers=tuple(tiers[r[3]]),
                bytes=int(r[5]),
                contract_digest=r[6],
                contract=loads_object(r[7]) if r[7] else None,
                metrics=loads_object(r[8]),
                published_at=float(r[9]),
                validated_at=None if r[10] is None else float(r[10]),
            )
            for r in firsts
        ]

    def failures(
        self, store: str | None = None, run_id: str | None = None, limit: int = 50
    ) -> list[FailureRecord]:
        """The newest ``limit`` failed saves, refused restores and failed validations
        together, newest first (``kind``: save, restore, validation)."""
        where, parameters = self._where(store, run_id)
        rows = self.query(
            "SELECT * FROM ("
            "SELECT 'save', run_id, store, step, error_type, error, seconds, finished_at, id "
            f"FROM saves{where}{' AND' if where else ' WHERE'} ok = 0 UNION ALL "
            "SELECT 'restore', run_id, store, step, error_type, error, seconds, finished_at, id "
            f"FROM restores{where}{' AND' if where else ' WHERE'} ok = 0 UNION ALL "
            "SELECT 'validation', run_id, store, step, error_type, error, seconds, "
            f"finished_at, id FROM validations{where}{' AND' if where else ' WHERE'} ok = 0) "
            "ORDER BY finished_at DESC, id DESC LIMIT ?",
            [*parameters, *parameters, *parameters, max(0, limit)],
        )
        return [
            FailureRecord(
                kind=r[0],
                run_id=r[1],
                store=r[2],
                step=None if r[3] is None else int(r[3]),
                error=r[4] or "",
                reason=r[5] or "",
                seconds=float(r[6]),
                finished_at=float(r[7]),
            )
            for r in rows
        ]


_INSERT_SAVE = (
    "INSERT INTO saves (run_id, store, step, generation_id, bytes, seconds, stall_seconds, "
    "stages, finished_at, ok, error_type, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
_INSERT_RESTORE = (
    "INSERT INTO restores (run_id, store, step, generation_id, seconds, stages, skipped, "
    "finished_at, ok, error_type, error) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _save_row(event: Published | SaveFailed, at: float) -> tuple[Any, ...]:
    """The values of ``_INSERT_SAVE``."""
    run = (event.run_id, event.store, event.step)
    seconds = (event.total_seconds, event.stall_seconds)
    if isinstance(event, SaveFailed):
        return (*run, None, 0, *seconds, "{}", at, 0, event.error, event.reason)
    stages = dumps(dict(event.stages))
    return (*run, event.generation_id, event.bytes, *seconds, stages, at, 1, None, None)


def _restore_row(event: Restored | Refused, at: float) -> tuple[Any, ...]:
    """The values of ``_INSERT_RESTORE``."""
    stages = dumps(dict(event.stages))
    run = (event.run_id, event.store)
    if isinstance(event, Refused):
        failure = (event.error, event.reason)
        return (*run, None, None, event.seconds, stages, len(event.rejected), at, 0, *failure)
    chosen = (event.step, event.generation_id)
    return (*run, *chosen, event.seconds, stages, len(event.skipped), at, 1, None, None)
