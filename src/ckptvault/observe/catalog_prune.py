"""Pruning the catalog: rows older than a horizon go, so the file stays bounded.

Every save, restore, validation and supervised attempt adds a row; a run that saves
every few minutes for months would grow the catalog without bound. Rows of *events*
(``saves``, ``restores``, ``validations``, ``attempts``) older than the horizon
(default 90 days) are deleted; the planner, ``status`` and the drills read only
recent ones. Rows of *generations* are not pruned by age: they describe generations
still held (a deletion removes its row) and carry the metrics retention ranks by.

The manager prunes once when its catalog recorder first writes
(``CheckpointManager(catalog_keep_days=90)``; ``None``: never); ``ckptvault catalog
--prune-older-than DAYS`` prunes on demand.
"""

from __future__ import annotations

import math
import time

from ckptvault.errors import UsageError
from ckptvault.observe.catalog import Catalog

DEFAULT_KEEP_DAYS = 90.0
_DAY = 86400.0
# table -> the column that says when its row happened
_EVENT_TABLES = {
    "saves": "finished_at",
    "restores": "finished_at",
    "validations": "finished_at",
    "attempts": "ended_at",
}


def check_keep_days(days: object, what: str = "catalog_keep_days") -> float | None:
    """``days`` as a float (None: keep every row); UsageError unless a number > 0."""
    if days is None:
        return None
    if (
        isinstance(days, bool)
        or not isinstance(days, (int, float))
        or not math.isfinite(days)
        or days <= 0
    ):
        raise UsageError(f"{what}={days!r} must be a number of days > 0, or None to keep all")
    return float(days)


def prune(catalog: Catalog, keep_days: float, now: float | None = None) -> dict[str, int]:
    """Delete the event rows older than ``keep_days`` before ``now`` (Unix seconds);
    how many went, by table. One transaction."""
    days = check_keep_days(keep_days)
    assert days is not None  # checked: a number
    cutoff = (time.time() if now is None else now) - days * _DAY
    removed = {}
    with catalog.transaction() as db:
        for table, column in _EVENT_TABLES.items():
            removed[table] = db.execute(
                f"DELETE FROM {table} WHERE {column} < ?", (cutoff,)
            ).rowcount
    return removed
