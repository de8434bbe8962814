"""``ckptvault doctor STORE [--json]``: the deployment's security and durability
posture, and what to fix. Exit status 1 when a check fails (0 with warnings only,
unless ``--strict``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptvault.cli._common import (
    STORE_HELP,
    S3EndpointUrl,
    open_store,
    print_json,
    print_table,
)
from ckptvault.cli.consolidate import parse_size
from ckptvault.errors import UsageError
from ckptvault.ops.doctor.diagnose import Places, RunPlan, diagnose
from ckptvault.ops.doctor.findings import FAIL, WARN

_STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "dim"}


def doctor(
    directory: Annotated[str, typer.Argument(help=STORE_HELP)],
    ledger: Annotated[
        Path | None, typer.Option(help="The rollback ledger (default: the per-user one).")
    ] = None,
    audit_log: Annotated[
        Path | None, typer.Option(help="The audit log (default: beside the ledger).")
    ] = None,
    keystore: Annotated[
        str | None, typer.Option(help="The key store directory or kms:// URL, when encrypted.")
    ] = None,
    signing_key: Annotated[
        Path | None, typer.Option(help="The Ed25519 private key that signs manifests.")
    ] = None,
    state_size: Annotated[
        str | None,
        typer.Option(
            help="What one rank saves, e.g. 40GB or 37GiB, to check that async staging fits "
            "in memory (default: the largest generation in the store)."
        ),
    ] = None,
    max_in_flight: Annotated[
        int, typer.Option(min=1, help="Async saves in flight, each one staged copy.")
    ] = 1,
    async_mode: Annotated[
        str, typer.Option(help="Where async saves are staged: thread or process (/dev/shm).")
    ] = "thread",
    ranks_per_node: Annotated[
        int, typer.Option(min=1, help="Ranks on each node, each staging its share.")
    ] = 1,
    retention_days: Annotated[
        float | None,
        typer.Option(
            min=0,
            help="How many days retention keeps generations, to check S3 lifecycle rules "
            "against (default: the age of the oldest generation in the store).",
        ),
    ] = None,
    strict: Annotated[bool, typer.Option(help="Exit 1 on warnings too.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list on stdout.")] = False,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """Check where the store, ledger, audit log, catalog and keys live, who can write
    them, the store's filesystem (Lustre striping, NFS mount options), whether async
    saves' staging fits in memory and, for S3 or Azure, the bucket's or container's protections, lifecycle
    rules and the credentials; say what to fix."""
    if async_mode not in ("thread", "process"):
        raise UsageError(f"--async-mode must be thread or process, not {async_mode[:40]!r}")
    size = parse_size(state_size, "--state-size") if state_size is not None else None
    plan = RunPlan(size, max_in_flight, async_mode, ranks_per_node, retention_days)
    store = open_store(directory, s3_endpoint_url)
    places = Places(ledger, audit_log, keystore, signing_key)
    findings = diagnose(store, places, plan)
    if as_json:
        print_json([f.to_json() for f in findings])
    else:
        rows = [[f.check, f.status, f.detail, f.fix or ""] for f in findings]
        print_table(("check", "status", "detail", "fix"), rows, styles={"status": _STYLE})
    bad = {FAIL, WARN} if strict else {FAIL}
    if any(f.status in bad for f in findings):
        raise typer.Exit(1)
