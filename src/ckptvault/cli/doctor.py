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
from ckptvault.ops.doctor.diagnose import Places, diagnose
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
    strict: Annotated[bool, typer.Option(help="Exit 1 on warnings too.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list on stdout.")] = False,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """Check where the store, ledger, audit log, catalog and keys live, who can write
    them and, for S3, the bucket's protections and the credentials; say what to fix."""
    store = open_store(directory, s3_endpoint_url)
    places = Places(ledger, audit_log, keystore, signing_key)
    findings = diagnose(store, places)
    if as_json:
        print_json([f.to_json() for f in findings])
    else:
        rows = [[f.check, f.status, f.detail, f.fix or ""] for f in findings]
        print_table(("check", "status", "detail", "fix"), rows, styles={"status": _STYLE})
    bad = {FAIL, WARN} if strict else {FAIL}
    if any(f.status in bad for f in findings):
        raise typer.Exit(1)
