"""``ckptvault sign STORE --signing-key K [--step N | --all]``: adopt signatures on an
existing run.

Each chosen generation is verified completely (every byte against its digests; an
encrypted manifest's MAC with ``--keystore``), then gets its ``manifest.sig``
(:mod:`ckptvault.ops.signing.sign`); the adoption goes to the audit log. Exit 0 when every
chosen generation of the run is signed; 1 when one failed verification or is signed
by another key (the others are signed; the report says which); 2 for a usage error,
with nothing signed.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from ckptvault.cli._common import (
    STORE_HELP,
    AuditLogOption,
    KeystoreOption,
    S3EndpointUrl,
    out,
    print_json,
    safe_markup,
)
from ckptvault.cli._progress import progress_bar
from ckptvault.errors import UsageError
from ckptvault.storage import S3Options
from ckptvault.trust.keystores import open_keystore

if TYPE_CHECKING:
    from ckptvault.ops.signing.sign import SignReport

_SigningKey = Annotated[
    Path, typer.Option("--signing-key", help="The private key to sign with (Ed25519 PEM).")
]
_Step = Annotated[int | None, typer.Option(help="Sign the generations of this step.")]
_Every = Annotated[bool, typer.Option("--all", help="Sign every generation.")]
_RunId = Annotated[
    str | None, typer.Option("--run-id", help="Sign this run's generations (default: the one run).")
]
_Replace = Annotated[
    bool,
    typer.Option(
        "--replace-signature",
        help="Re-sign generations signed by another key, once that signature verifies with "
        "a --trusted-key.",
    ),
]
_TrustedKeys = Annotated[
    list[Path] | None,
    typer.Option("--trusted-key", help="Whose signatures --replace-signature may replace."),
]
_Ledger = Annotated[
    Path | None, typer.Option("--ledger", help="The ledger (abandoned generations, audit head).")
]


def sign(
    # One parameter per command-line option: the declarations are long, the body is steps.
    store: Annotated[str, typer.Argument(help=STORE_HELP)],
    signing_key: _SigningKey,
    step: _Step = None,
    every: _Every = False,
    run_id: _RunId = None,
    replace_signature: _Replace = False,
    trusted_key: _TrustedKeys = None,
    keystore: KeystoreOption = None,
    ledger: _Ledger = None,
    audit_log: AuditLogOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON report on stdout.")] = False,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """Verify generations completely, then sign them (newest, --step N or --all).

    For a run that started unsigned: afterwards trusted_keys= restores its history.
    Run it between training jobs (it takes the store's writer lock).
    """
    from ckptvault.ops.signing.sign import sign_generations

    if step is not None and every:
        raise UsageError("--step and --all are mutually exclusive")
    with progress_bar("verifying and signing", "items", as_json=as_json) as bar:
        report = sign_generations(
            store,
            signing_key,
            step=step,
            every=every,
            run_id=run_id,
            replace_signatures=replace_signature,
            trusted_keys=trusted_key or None,
            keystore=open_keystore(keystore) if keystore else None,
            ledger=ledger,
            audit_log=audit_log,
            s3=S3Options.from_keywords(endpoint_url=s3_endpoint_url),
            progress=bar,
        )
    if as_json:
        print_json(report.to_json())
    else:
        _print_report(report)
    if not report.ok:
        raise typer.Exit(1)


def _print_report(report: SignReport) -> None:
    counts = ", ".join(f"{n} {name}" for name, n in report.counts().items() if n)
    out.print(
        f"run {safe_markup(repr(report.run_id))} in {safe_markup(report.store)}, key "
        f"{safe_markup(report.key_id)}: {counts or 'nothing chosen'}"
    )
    for g in report.generations:
        # Details quote the store (names, run ids, reasons): escaped for the terminal.
        detail = f"  {safe_markup(g.detail)}" if g.detail else ""
        out.print(f"  step {g.step} ({safe_markup(g.generation_id)}): {g.outcome}{detail}")
    if not report.ok:
        out.print(
            "not every generation was signed: those failed or refused stay unsigned (a "
            "trusted restore skips them); fix or delete them, or see --replace-signature"
        )
