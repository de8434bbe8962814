"""``ckptvault catalog``: recent saves (with stage timings), restores and failures.

Reads the catalog the manager writes (:mod:`ckptvault.observe.catalog`): by
default the one beside the default ledger; ``--ledger PATH`` the one beside that
ledger; ``--catalog PATH`` that file. ``--json`` prints one object with the lists
``saves``, ``restores``, ``failures``, ``generations`` and ``attempts`` (starts of
jobs under ``ckptvault supervise``; not with ``--store``: attempts are not recorded
per store). ``--store`` naming a store the catalog records nothing of is an error
(exit 2) that names the stores it does record. ``--prune-older-than DAYS`` first
deletes the rows of events older than DAYS (:mod:`ckptvault.observe.catalog_prune`;
a manager prunes at 90 days by default, ``catalog_keep_days=``).
"""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated

import typer

from ckptvault.cli._common import (
    CatalogLedgerOption,
    CatalogPathOption,
    catalog_file,
    err,
    human_bytes,
    out,
    print_json,
    print_table,
    safe_markup,
)
from ckptvault.errors import UsageError
from ckptvault.observe.catalog import (
    Catalog,
    FailureRecord,
    RestoreRecord,
    SaveRecord,
    store_key,
)
from ckptvault.observe.catalog_attempts import AttemptRecord, recent_attempts
from ckptvault.observe.catalog_prune import DEFAULT_KEEP_DAYS, check_keep_days, prune

_STORES_SHOWN = 5  # stores named when --store names one the catalog does not know
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
    prune_older_than: Annotated[
        float | None,
        typer.Option(
            "--prune-older-than",
            metavar="DAYS",
            help="First delete rows of saves, restores, validations and attempts older than "
            f"DAYS (a manager does this at {DEFAULT_KEEP_DAYS:g} days by default).",
        ),
    ] = None,
) -> None:
    """Show recent saves (with stage timings), restores and failures from the catalog."""
    path = catalog_file(ledger, catalog_path, required=True)
    assert path is not None  # required: an error otherwise
    if prune_older_than is not None:
        _prune(path, prune_older_than, as_json)
    key = store_key(store) if store is not None else None
    with Catalog(path) as book:
        saves = book.recent_saves(key, run_id, limit)
        restores = book.recent_restores(key, run_id, limit)
        failures = book.failures(key, run_id, limit)
        generations = book.generations(key, run_id)[:limit]
        if key is not None and not (saves or restores or failures or generations):
            _unknown_store(book, str(store), path)
        # Attempts are not recorded per store: with --store, none can be told to be its.
        attempts = recent_attempts(book, limit=limit) if key is None else []
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


def _prune(path: Path, days: float, as_json: bool) -> None:
    check_keep_days(days, "--prune-older-than")
    with Catalog(path) as book:
        removed = prune(book, days)
    note = ", ".join(f"{count} {table}" for table, count in removed.items())
    (err if as_json else out).print(f"pruned rows older than {days:g} days: {note}")


def _unknown_store(book: Catalog, store: str, path: object) -> None:
    """--store names a store the catalog records nothing of (a typo, or a store no
    manager with this catalog used): exit 2 naming the ones it does record."""
    known = book.stores(_STORES_SHOWN + 1)
    shown = ", ".join(known[:_STORES_SHOWN]) + (", ..." if len(known) > _STORES_SHOWN else "")
    raise UsageError(
        f"--store {store}: the catalog {path} records nothing of this store; "
        + (f"it records {shown}" if known else "it records no store yet")
        + " (a manager records the store it saves to, with the catalog beside its ledger)"
    )


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
