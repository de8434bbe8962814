"""The catalog's SQLite file: opened private, in WAL mode, versioned, shared by threads.

Several processes may write one catalog at once (the trainer, ``ckptvault``
commands): WAL lets readers run beside a writer, and a busy timeout makes a writer
wait for another's short transaction instead of failing. The file is created
``0o600`` in a ``0o700`` directory before SQLite opens it (SQLite gives its ``-wal``
and ``-shm`` files the database file's mode). Commits are ``synchronous=NORMAL``: a
power cut may lose the newest rows, never corrupt the file; the catalog is a record
of what happened, not a trust anchor.
"""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any

from ckptvault.errors import CatalogError
from ckptvault.observe.catalog_schema import SCHEMA_VERSION, TABLES

BUSY_TIMEOUT_S = 10.0  # a writer waits this long for another process's transaction


class CatalogFile:
    """An open catalog database (created with its tables when missing).

    Raises :class:`~ckptvault.errors.CatalogError` when the file cannot be created or
    opened, is not a SQLite database, or was written by a newer ckptvault; reads and
    writes raise it for any database error.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(os.path.abspath(os.fspath(path)))
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = self._open()

    def _open(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.close(os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600))
            db = sqlite3.connect(
                self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
            )
        except (OSError, sqlite3.Error) as exc:
            raise self._error("cannot be opened", exc) from exc
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._ensure_schema(db)
        except BaseException as exc:
            db.close()
            if isinstance(exc, sqlite3.Error):
                raise self._error("cannot be opened", exc) from exc
            raise
        return db

    def _ensure_schema(self, db: sqlite3.Connection) -> None:
        """Create the tables unless they exist at this version (one read, most times)."""
        version = self._version(db)
        if version is None or version < SCHEMA_VERSION:
            db.execute("BEGIN IMMEDIATE")
            try:
                for statement in TABLES:
                    db.execute(statement)
                version = self._version(db)
                if version is None or version < SCHEMA_VERSION:  # new, or brought along
                    db.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
                    version = SCHEMA_VERSION
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")
        if version is not None and version > SCHEMA_VERSION:
            raise CatalogError(
                f"the catalog {self.path} has schema version {version}, newer than this "
                f"ckptvault understands ({SCHEMA_VERSION}): upgrade ckptvault, or give "
                "catalog= (--catalog) another file"
            )

    @staticmethod
    def _version(db: sqlite3.Connection) -> int | None:
        try:
            row = db.execute("SELECT MAX(version) FROM schema_version").fetchone()
        except sqlite3.OperationalError:  # no such table: a new file
            return None
        return int(row[0]) if row and row[0] is not None else None

    def _error(self, what: str, exc: BaseException) -> CatalogError:
        return CatalogError(
            f"the catalog {self.path} {what}: {exc}. Check the file and its directory "
            "(permissions, free space), or give catalog= (--catalog) another path"
        )

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            raise CatalogError(f"the catalog {self.path} was closed; open it again")
        return self._db

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """One short write transaction, serialized among this object's threads."""
        with self._lock:
            db = self._connection()
            try:
                db.execute("BEGIN IMMEDIATE")
                try:
                    yield db
                except BaseException:
                    db.execute("ROLLBACK")
                    raise
                db.execute("COMMIT")
            except sqlite3.Error as exc:
                raise self._error("could not be written", exc) from exc

    def query(self, sql: str, parameters: Sequence[Any]) -> list[Any]:
        with self._lock:
            try:
                return self._connection().execute(sql, parameters).fetchall()
            except sqlite3.Error as exc:
                raise self._error("could not be read", exc) from exc

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None

    def __enter__(self) -> CatalogFile:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
