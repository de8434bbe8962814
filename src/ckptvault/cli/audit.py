"""``ckptvault audit verify PATH``: check an audit log's hash chain, its gaps and its head."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptvault.cli._common import err, out, print_json, safe_markup
from ckptvault.errors import UsageError
from ckptvault.trust.audit_verify import verify_audit_log
from ckptvault.trust.ledger import Ledger, default_ledger_path

app = typer.Typer(help="The hash-chained audit log.", no_args_is_help=True)


@app.command("verify")
def verify(
    path: Annotated[Path, typer.Argument(help="The audit log (JSON lines).")],
    ledger: Annotated[Path | None, typer.Option(help="Ledger holding the log's head.")] = None,
    allow_missing_head: Annotated[
        bool,
        typer.Option(help="Accept a log whose head the ledger lacks (a cut-off tail goes unseen)."),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
) -> None:
    """Exit 0 only if no entry was removed, edited, reordered, appended or cut off, and
    the log records no gap (a loss found, and recorded, by a later append)."""
    if not path.is_file():
        raise UsageError(f"no audit log at {path}")
    ledger_path = ledger or default_ledger_path()
    report = verify_audit_log(path, Ledger(ledger_path) if ledger_path.exists() else None)
    if not report.head_checked and not allow_missing_head:
        report.problems.append(
            f"{ledger_path} holds no head for this log, so a cut-off tail cannot be detected; "
            "pass the ledger it was written with (--ledger), or --allow-missing-head"
        )
    if as_json:
        print_json(
            {
                "path": report.path,
                "ok": report.ok,
                "entries": report.entries,
                "head_checked": report.head_checked,
                "gaps": report.gaps,
                "problems": report.problems,
            }
        )
    else:
        for problem in report.problems:
            out.print(f"[red]FAIL[/red] {safe_markup(problem)}", markup=True)
        if report.ok:
            out.print(f"[green]OK[/green]   {report.entries} entries, chain intact")
            if not report.head_checked:
                err.print(
                    f"note: {ledger_path} holds no head for this log; a cut-off tail cannot be detected"
                )
    if not report.ok:
        raise typer.Exit(1)
