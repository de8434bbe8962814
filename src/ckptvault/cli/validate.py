"""``ckptvault validate STORE --run-id R --factory module:function [--step N | --every K]``:
load generations into freshly built objects and run the factory's check; the
catalog records each success, and retention never prunes the newest validated one.
Exit status 1 when a validation fails."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ckptvault.cli._common import (
    STORE_HELP,
    KeystoreOption,
    LedgerOption,
    S3EndpointUrl,
    TrustedKeys,
    open_store,
    out,
    print_json,
    safe_markup,
)
from ckptvault.errors import UsageError


def validate(
    store: Annotated[str, typer.Argument(help=STORE_HELP)],
    run_id: Annotated[str, typer.Option("--run-id", help="The run id the job saves with.")],
    factory: Annotated[
        str,
        typer.Option(
            help="module:function (imported from the current directory first, as "
            "python -m does) or path/to/file.py:function, returning the state to restore "
            "into (all of it or a part, the model alone say), or (state, check)."
        ),
    ],
    step: Annotated[int | None, typer.Option(help="Validate this step (default: newest).")] = None,
    every: Annotated[
        int | None,
        typer.Option(help="Validate every K-th listed generation, newest first (a sample)."),
    ] = None,
    trusted_key: TrustedKeys = None,
    keystore: KeystoreOption = None,
    ledger: LedgerOption = None,
    catalog: Annotated[
        Path | None, typer.Option(help="The catalog to record in (default: beside the ledger).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list on stdout.")] = False,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """Load generations into objects the factory builds and run its check."""
    import ckptvault as cv  # imports torch
    from ckptvault.restoring.validation import load_factory

    if step is not None and every is not None:
        raise UsageError("give --step N or --every K, not both")
    if every is not None and every < 1:
        raise UsageError(f"--every must be >= 1, got {every}")
    build = load_factory(factory)
    open_store(store, s3_endpoint_url)  # must exist: the manager would start an empty one
    with cv.CheckpointManager(
        store,
        run_id=run_id,
        trusted_keys=trusted_key or None,
        keystore=keystore,
        ledger=ledger,
        catalog=catalog,
        s3_endpoint_url=s3_endpoint_url,
    ) as mgr:
        listed = mgr.generations()[::every] if every is not None else None
        steps: list[int | None] = [i.step for i in listed] if listed is not None else [step]
        results = [mgr.validate(build, s) for s in steps]
    if as_json:
        print_json([r.to_json() for r in results])
    else:
        table = Table(box=None, pad_edge=False)
        for column in ("step", "generation id", "result", "seconds"):
            table.add_column(column, overflow="fold")
        for r in results:
            verdict = "[green]ok[/]" if r.ok else f"[bold red]failed[/] {safe_markup(r.error)}"
            table.add_row(
                str(r.step), safe_markup(r.generation_id or "-"), verdict, f"{r.seconds:.2f}"
            )
        out.print(table)
    if not all(r.ok for r in results):
        raise typer.Exit(1)
