"""The catalog stays bounded: rows of events older than a horizon (default 90 days)
are pruned by the manager when it first writes, or by ``ckptvault catalog
--prune-older-than DAYS``; generations' rows stay."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import UsageError
from ckptvault.observe.catalog import Catalog
from ckptvault.observe.catalog_attempts import AttemptRecord, record_attempt
from ckptvault.observe.catalog_prune import check_keep_days
from support.common import run_cli

DAY = 86400.0


def age(catalog: Path, days_ago: float) -> None:
    """One save row and one supervised attempt that happened ``days_ago``."""
    when = time.time() - days_ago * DAY
    with Catalog(catalog) as book:
        with book.transaction() as db:
            db.execute(
                "INSERT INTO saves (run_id, store, step, generation_id, bytes, seconds, "
                "stall_seconds, stages, finished_at, ok) VALUES "
                "('old', '/old', 1, NULL, 0, 1.0, 1.0, '{}', ?, 1)",
                (when,),
            )
        attempt = AttemptRecord("s", 1, "job", 1, when, when, 0, None, "finish", "ok", "done")
        record_attempt(book, attempt)


def counts(catalog: Path) -> dict[str, int]:
    with Catalog(catalog) as book:
        tables = ("saves", "attempts", "generations")
        return {t: book.query(f"SELECT COUNT(*) FROM {t}", [])[0][0] for t in tables}


def save(store: Path, catalog: Path, **options: object) -> None:
    with cv.CheckpointManager(store, run_id="r", catalog=catalog, **options) as mgr:  # type: ignore[arg-type]
        mgr.save(1, {"w": torch.ones(2)})


def test_the_manager_prunes_rows_past_the_horizon_once(tmp_path: Path):
    catalog = tmp_path / "catalog.sqlite3"
    age(catalog, 91)
    age(catalog, 89)
    save(tmp_path / "store", catalog)  # default: 90 days
    assert counts(catalog) == {"saves": 2, "attempts": 1, "generations": 1}


def test_the_horizon_is_the_managers_option(tmp_path: Path):
    catalog = tmp_path / "catalog.sqlite3"
    age(catalog, 91)
    save(tmp_path / "kept", catalog, catalog_keep_days=None)  # never
    assert counts(catalog)["saves"] == 2
    save(tmp_path / "pruned", catalog, catalog_keep_days=7)
    assert counts(catalog) == {"saves": 2, "attempts": 0, "generations": 2}
    with pytest.raises(UsageError, match="catalog_keep_days=0"):
        check_keep_days(0)


def test_catalog_prune_older_than(tmp_path: Path):
    catalog = tmp_path / "catalog.sqlite3"
    age(catalog, 40)
    age(catalog, 10)
    result = run_cli("catalog", "--catalog", catalog, "--prune-older-than", "30")
    assert result.returncode == 0, result.stderr
    assert "pruned rows older than 30 days: 1 saves, 0 restores" in result.stdout
    assert counts(catalog) == {"saves": 1, "attempts": 1, "generations": 0}
    bad = run_cli("catalog", "--catalog", catalog, "--prune-older-than", "0")
    assert bad.returncode == 2 and "--prune-older-than" in bad.stderr
