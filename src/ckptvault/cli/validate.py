"""``ckptvault validate STORE --run-id R --factory module:function [--step N | --every K]``:
load generations into freshly built objects and run the factory's check; the
catalog records each success, and retention never prunes the newest validated one.
Exit status 1 when a validation fails."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptvault.cli._common import (
    STORE_HELP,
    KeystoreOption,
    LedgerOption,
    S3EndpointUrl,
    TrustedKeys,
    open_store,
    print_json,
    print_table,
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
        rows = [
            [
                str(r.step),
                r.generation_id or "-",
                "ok" if r.ok else "failed",
                f"{r.seconds:.2f}",
                "" if r.ok else str(r.error),
            ]
            for r in results
        ]
        print_table(
            ("step", "generation id", "result", "seconds", "error"),
            rows,
            right=("step", "seconds"),
            styles={"result": {"ok": "green", "failed": "bold red"}},
        )
    if not all(r.ok for r in results):
        raise typer.Exit(1)
