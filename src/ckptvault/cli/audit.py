"""``ckptvault audit verify [LOG] [--ledger PATH]``: check an audit log's hash chain,
its gaps and its head.

The log and the ledger that keeps its head are found from each other, as ckptvault
writes them: without LOG, ``audit.jsonl`` beside the ledger (``--ledger``, or the
default one in the per-user state directory); without ``--ledger``, the ledger beside
LOG when one there keeps its head, else the default ledger.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptvault.cli._common import err, out, print_json, safe_markup
from ckptvault.errors import UsageError
from ckptvault.trust.audit import default_audit_path
from ckptvault.trust.audit_verify import verify_audit_log
from ckptvault.trust.ledger import Ledger, default_ledger_path

app = typer.Typer(help="The hash-chained audit log.", no_args_is_help=True)

LEDGER_NAME = default_ledger_path().name


def _holds_head(ledger: Path, log: Path) -> bool:
    """Whether ``ledger`` exists and keeps the head of ``log`` (never creates it)."""
    if not ledger.is_file():
        return False
    return Ledger(ledger).audit_head(str(log.resolve())) is not None


def locate(path: Path | None, ledger: Path | None) -> tuple[Path, Path]:
    """The log and the ledger to check it against (see the module docstring)."""
    if path is None:
        ledger = ledger or default_ledger_path()
        return default_audit_path(Ledger(ledger)), ledger
    if ledger is not None:
        return path, ledger
    beside = path.resolve().parent / LEDGER_NAME
    default = default_ledger_path()
    for candidate in (beside, default):
        if _holds_head(candidate, path):
            return path, candidate
    return path, beside if beside.is_file() else default


@app.command("verify")
def verify(
    path: Annotated[
        Path | None,
        typer.Argument(help="The audit log (JSON lines; default: the one beside the ledger)."),
    ] = None,
    ledger: Annotated[
        Path | None,
        typer.Option(
            "--ledger",
            help="Ledger holding the log's head (default: the one beside the log, else the "
            "per-user one).",
        ),
    ] = None,
    allow_missing_head: Annotated[
        bool,
        typer.Option(help="Accept a log whose head the ledger lacks (a cut-off tail goes unseen)."),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
) -> None:
    """Exit 0 only if no entry was removed, edited, reordered, appended or cut off, and
    the log records no gap (a loss found, and recorded, by a later append)."""
    path, ledger_path = locate(path, ledger)
    if not path.is_file():
        raise UsageError(f"no audit log at {path}; give its path (ckptvault audit verify LOG)")
    report = verify_audit_log(path, Ledger(ledger_path) if ledger_path.is_file() else None)
    if not report.head_checked and not allow_missing_head:
        report.problems.append(
            f"{ledger_path} holds no head for this log, so a cut-off tail cannot be detected; "
            "pass the ledger it was written with (--ledger), or --allow-missing-head"
        )
    if as_json:
        print_json(
            {
                "path": report.path,
                "ledger": str(ledger_path),
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
            out.print(
                f"[green]OK[/green]   {safe_markup(report.path)}: {report.entries} entries, "
                "chain intact"
            )
            if not report.head_checked:
                err.print(
                    f"note: {safe_markup(ledger_path)} holds no head for this log; a cut-off "
                    "tail cannot be detected"
                )
    if not report.ok:
        raise typer.Exit(1)
