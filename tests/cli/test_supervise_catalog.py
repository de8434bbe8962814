"""Every attempt of a supervised job is recorded in the catalog, beside the job's
own saves and restores."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

from support.common import run_cli


def _flaky_job(tmp_path: Path) -> list[str]:
    """A job that fails on its first start and succeeds on the second."""
    script = tmp_path / "job.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import pathlib, sys
            marker = pathlib.Path({str(tmp_path / "started")!r})
            first = not marker.exists()
            marker.touch()
            sys.exit(3 if first else 0)
            """
        )
    )
    return [sys.executable, str(script)]


def test_the_catalog_shows_every_attempt(tmp_path: Path):
    catalog = tmp_path / "catalog.sqlite3"
    result = run_cli(
        "supervise", "--backoff", "0", "--catalog", str(catalog), "--", *_flaky_job(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    shown = run_cli("catalog", "--catalog", str(catalog), "--json")
    attempts = json.loads(shown.stdout)["attempts"]
    assert [(a["attempt"], a["exit_code"], a["decision"]) for a in attempts] == [
        (1, 3, "restart"),
        (2, 0, "finish"),
    ]
    assert len({a["supervise_id"] for a in attempts}) == 1
    assert all(a["ended_at"] >= a["started_at"] and a["pid"] for a in attempts)
    assert "job.py" in attempts[0]["command"]
    table = run_cli("catalog", "--catalog", str(catalog))
    assert "supervised attempts" in table.stdout


def test_no_catalog_records_nothing(tmp_path: Path):
    catalog = tmp_path / "catalog.sqlite3"
    result = run_cli("supervise", "--backoff", "0", "--no-catalog", "--", *_flaky_job(tmp_path))
    assert result.returncode == 0, result.stderr
    assert not catalog.exists()


def test_an_unwritable_catalog_never_stops_the_job(tmp_path: Path):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")
    catalog = blocked / "catalog.sqlite3"  # its directory cannot be created
    result = run_cli(
        "supervise", "--backoff", "0", "--catalog", str(catalog), "--", *_flaky_job(tmp_path)
    )
    assert result.returncode == 0, result.stderr
    assert "could not be recorded in the catalog" in result.stderr
