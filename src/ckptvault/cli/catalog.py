"""``ckptvault catalog``: recent saves (with stage timings), restores and failures.

Reads the catalog the manager writes (:mod:`ckptvault.observe.catalog`): by
default the one beside the default ledger; ``--ledger PATH`` the one beside that
ledger; ``--catalog PATH`` that file. ``--json`` prints one object with the lists
``saves``, ``restores``, ``failures``, ``generations`` and ``attempts`` (starts of
jobs under ``ckptvault supervise``).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Annotated

import typer

from ckptvault.cli._common import (
    CatalogLedgerOption,
    CatalogPathOption,
    catalog_file,
    human_bytes,
    out,
    print_json,
    print_table,
    safe_markup,
)
from ckptvault.observe.catalog import (
    Catalog,
    FailureRecord,
    RestoreRecord,
    SaveRecord,
    store_key,
)
from ckptvault.observe.catalog_attempts import AttemptRecord, recent_attempts

SAVE_STAGES = ("stage", "write", "fsync", "publish")
RESTORE_STAGES = ("discovery", "verification", "read", "apply")


def catalog(
    ledger: CatalogLedgerOption = None,
    catalog_path: CatalogPathOption = None,
    store: Annotated[
        str | None, typer.Option("--store", help="Only this store (path or URL).")
    ] = None,
    run_id: Annotated[str | None, typer.Option("--run-id", help="Only this run.")] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="Rows per list.")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
) -> None:
    """Show recent saves (with stage timings), restores and failures from the catalog."""
    path = catalog_file(ledger, catalog_path, required=True)
    assert path is not None  # required: an error otherwise
    key = store_key(store) if store is not None else None
    with Catalog(path) as book:
        saves = book.recent_saves(key, run_id, limit)
        restores = book.recent_restores(key, run_id, limit)
        failures = book.failures(key, run_id, limit)
        generations = book.generations(key, run_id)[:limit]
        attempts = recent_attempts(book, limit=limit)
    if as_json:
        print_json(
            {
                "catalog": str(path),
                "saves": [r.to_json() for r in saves],
                "restores": [r.to_json() for r in restores],
                "failures": [r.to_json() for r in failures],
                "generations": [r.to_json() for r in generations],
                "attempts": [r.to_json() for r in attempts],
            }
        )
        return
    out.print(f"catalog {safe_markup(path)}")
    _print_saves(saves)
    _print_restores(restores)
    _print_failures(failures)
    _print_attempts(attempts)


def _when(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%m-%d %H:%M:%S")


def _seconds(value: float | None) -> str:
    return "" if value is None else f"{value:.3f}"


def _print_saves(saves: list[SaveRecord]) -> None:
    if not saves:
        out.print("no saves recorded")
        return
    stage_columns = [f"{name} s" for name in SAVE_STAGES]
    columns = ["UTC", "run", "step", "size", "total s", "stall s", *stage_columns]
    rows = []
    for r in saves:
        stages = [_seconds(r.stages.get(name)) for name in SAVE_STAGES]
        outcome = "ok" if r.ok else f"FAILED {r.error}"
        row = [_when(r.finished_at), r.run_id, str(r.step), human_bytes(r.bytes)]
        rows.append([*row, _seconds(r.seconds), _seconds(r.stall_seconds), *stages, outcome])
    # Run ids and errors come from the catalog: print_table escapes every cell.
    print_table([*columns, "outcome"], rows, right={"step", "size", *columns[4:]}, title="saves")


def _print_restores(restores: list[RestoreRecord]) -> None:
    if not restores:
        out.print("no restores recorded")
        return
    stage_columns = [f"{name} s" for name in RESTORE_STAGES]
    columns = ["UTC", "run", "step", "total s", *stage_columns, "skipped"]
    rows = []
    for r in restores:
        stages = [_seconds(r.stages.get(name)) for name in RESTORE_STAGES]
        step = "" if r.step is None else str(r.step)
        outcome = "ok" if r.ok else f"REFUSED {r.error}"
        row = [_when(r.finished_at), r.run_id, step, _seconds(r.seconds), *stages]
        rows.append([*row, str(r.skipped), outcome])
    right = {"step", "skipped", *columns[3:]}
    print_table([*columns, "outcome"], rows, right=right, title="restores")


def _print_failures(failures: list[FailureRecord]) -> None:
    if not failures:
        out.print("no failures recorded")
        return
    rows = [
        [
            _when(r.finished_at),
            r.kind,
            r.run_id,
            "" if r.step is None else str(r.step),
            f"{r.error}: {r.reason}",
        ]
        for r in failures
    ]
    print_table(["UTC", "kind", "run", "step", "error"], rows, right={"step"}, title="failures")


def _print_attempts(attempts: list[AttemptRecord]) -> None:
    """Starts of jobs under ``ckptvault supervise``, oldest first."""
    if not attempts:
        return
    rows = []
    for a in attempts:
        ended = f"exit {a.exit_code}" if a.exit_code is not None else (a.signal or "not started")
        rows.append(
            [
                _when(a.started_at),
                a.supervise_id,
                str(a.attempt),
                ended,
                f"{a.decision}: {a.reason}",
            ]
        )
    columns = ["UTC", "run", "#", "ended", "decision"]
    print_table(columns, rows, right={"#"}, title="supervised attempts")
