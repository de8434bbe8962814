"""``ckptvault verify DIR [--step N | --all] [--json]``: check generations byte by byte.

Without a flag the newest generation is checked. Exit status 0 only when every
generation checked verifies; each failing rule is printed with its file and reason.
The JSON report's ``signer`` is a key id only when the signature was verified against
a ``--trusted-key``; ``"unverified"`` when the generation is signed but no trusted key
was given; null when it is unsigned. With ``--keystore`` (an encrypted run) a
generation must also be encrypted throughout and carry a manifest MAC made with the
run's key, as restore requires; without it, ``notes`` says the MAC was not checked.
With ``--ledger``, a generation an allowed rollback abandoned fails (``rollback``):
restore would never take it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer

from ckptvault.cli._common import (
    STORE_HELP,
    KeystoreOption,
    S3EndpointUrl,
    human_bytes,
    open_store,
    out,
    print_json,
    safe_markup,
    safe_text,
    select,
)
from ckptvault.cli._progress import progress_bar
from ckptvault.errors import UsageError
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import (
    UNVERIFIED_SIGNER,
    TrustPolicy,
    VerificationReport,
    verify_generation,
)
from ckptvault.trust.context import TrustContext
from ckptvault.trust.keystores import open_keystore
from ckptvault.trust.ledger import Ledger
from ckptvault.trust.signing import TrustedKeys

VerifyLedgerOption = Annotated[
    Path | None,
    typer.Option(
        "--ledger",
        help="The rollback ledger: generations an allowed rollback abandoned fail (needs --run-id).",
    ),
]


def verify(
    directory: Annotated[str, typer.Argument(help=STORE_HELP)],
    step: Annotated[int | None, typer.Option(help="Check the generations of this step.")] = None,
    every: Annotated[bool, typer.Option("--all", help="Check every generation.")] = False,
    run_id: Annotated[str | None, typer.Option(help="Also require this run id.")] = None,
    trusted_key: Annotated[
        list[Path] | None,
        typer.Option("--trusted-key", help="Require a signature by this public key (repeatable)."),
    ] = None,
    keystore: KeystoreOption = None,
    ledger: VerifyLedgerOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON report on stdout.")] = False,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """Verify manifests, file sets, sizes and every digest."""
    if step is not None and every:
        raise UsageError("--step and --all are mutually exclusive")
    if ledger is not None and run_id is None:
        raise UsageError("--ledger needs --run-id: the ledger keeps each run's record apart")
    store = open_store(directory, s3_endpoint_url)
    trust = TrustContext(
        trusted=TrustedKeys.load(trusted_key) if trusted_key else None,
        keystore=open_keystore(keystore) if keystore else None,
        ledger=Ledger(ledger) if ledger is not None else None,
    )
    trust.check_outside(store)
    floor = trust.floor(run_id) if run_id is not None else None
    policy = dataclasses.replace(
        # Abandonment only: an older step may still be restored on purpose.
        trust.policy(run_id, floor.without_step() if floor else None),
        authenticate=keystore is not None,  # without a key: integrity only, and a note
    )
    chosen = select(store, step, every, trust)
    reports = [_verify_one(store, ref, policy, as_json) for ref in chosen]
    if as_json:
        print_json([_report_json(report) for report in reports])
    else:
        for report in reports:
            _print_report(report)
    if not all(report.ok for report in reports):
        raise typer.Exit(1)


def _verify_one(
    store: Store, ref: GenerationRef, policy: TrustPolicy, as_json: bool
) -> VerificationReport:
    with progress_bar(f"verifying step {ref.step}", as_json=as_json) as progress:
        return verify_generation(store, ref, policy, progress=progress)


def _report_json(report: VerificationReport) -> dict[str, Any]:
    return {
        "step": report.ref.step,
        "generation_id": report.ref.generation_id,
        "path": report.ref.location,
        "ok": report.ok,
        "bytes": report.manifest.stored_bytes if report.manifest else None,
        "signer": report.signer,
        "encrypted": bool(report.manifest and report.manifest.encryption),
        "problems": [{"code": p.code, "file": p.file, "detail": p.detail} for p in report.problems],
        "notes": _notes(report),
    }


def _notes(report: VerificationReport) -> list[str]:
    """What this check could not cover. Not failures: verify runs without a key."""
    manifest = report.manifest
    if manifest is None or manifest.encryption is None:
        return []
    if report.signer not in (None, UNVERIFIED_SIGNER):
        return []  # the verified signature covers the whole manifest
    if report.authenticated:
        return []  # the MAC was checked with the run's key
    return [
        "encrypted and not signed by a trusted key: the digests were checked, but the "
        "manifest's MAC needs the run's key and was not (restore and export check it)"
    ]


def _print_report(report: VerificationReport) -> None:
    ref = report.ref
    if report.ok:
        size = human_bytes(report.manifest.stored_bytes) if report.manifest else "?"
        files = len(report.manifest.files) if report.manifest else 0
        out.print(
            f"[green]OK[/green]   step {ref.step}  {safe_markup(ref.generation_id)}  "
            f"({files} files, {size})"
        )
    else:
        out.print(
            f"[red]FAIL[/red] step {ref.step}  {safe_markup(ref.generation_id)}  "
            f"{safe_markup(ref.location)}"
        )
        for problem in report.problems:
            where = (
                f"{problem.file}: "
                if problem.file and not problem.detail.startswith(problem.file)
                else ""
            )
            # Details quote the store (key ids, run ids, names): never raw on a terminal.
            out.print(safe_text(f"     - {problem.code}: {where}{problem.detail}"), markup=False)
    for note in _notes(report):
        out.print(f"     note: {note}", markup=False)
