"""``ckptvault keys ...``: signing keys and per-run encryption keys.

- ``keys generate --private PATH --public PATH``: a new Ed25519 key pair
  (private key written with mode 0600).
- ``keys list --keystore K [--json]``: runs, key ids, destroyed keys.
- ``keys destroy --keystore K --run RUN --yes``: crypto-erase a run; every
  generation and copy of it becomes unreadable. Recorded in the audit log.
- ``keys rotate --keystore K --run RUN --store URL [--store URL ...] [--signing-key K]
  [--trusted-key P]``: a new KEK for the run, every generation re-wrapped without
  rewriting a tensor file (``ckptvault.ops.rotation.rotate``). Recorded in the audit log.

``K`` is a key store directory or a ``kms://`` URL (AWS KMS, see
``ckptvault.trust.kms.keystore``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ckptvault.cli._common import S3EndpointUrl, out, print_json, print_table, safe_markup
from ckptvault.cli._progress import progress_bar
from ckptvault.errors import UsageError
from ckptvault.ops.rotation.report import FAILED, NOT_REACHED, RotationReport
from ckptvault.storage import S3Options
from ckptvault.trust.context import TrustContext
from ckptvault.trust.keystores import open_keystore
from ckptvault.trust.signing import generate_keypair

KEYSTORE_HELP = "The key store: a directory, or a kms:// URL (AWS KMS)."

app = typer.Typer(help="Signing keys and per-run encryption keys.", no_args_is_help=True)


@app.command("generate")
def generate(
    private: Annotated[
        Path, typer.Option("--private", help="Where to write the private key (0600).")
    ],
    public: Annotated[Path, typer.Option("--public", help="Where to write the public key.")],
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the key id and paths as JSON.")
    ] = False,
) -> None:
    """Generate an Ed25519 signing key pair."""
    key_id = generate_keypair(private, public)
    if as_json:
        print_json({"key_id": key_id, "private": str(private), "public": str(public)})
        return
    out.print(f"generated key {key_id}")
    out.print(f"  private: {private} (keep it on the trainer only)")
    out.print(f"  public:  {public} (give it to every verifier)")


@app.command("list")
def list_keys(
    keystore: Annotated[str, typer.Option("--keystore", help=KEYSTORE_HELP)],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
) -> None:
    """List the runs in a key store, their key ids, and destroyed keys."""
    if not keystore.startswith("kms://") and not Path(keystore).is_dir():
        # An empty listing would read as "this store has no keys": say it is not there.
        raise UsageError(
            f"--keystore {keystore}: no key store directory there; give the directory the "
            "training run keeps its keys in, or a kms:// URL"
        )
    infos = open_keystore(keystore).list_keys()
    if as_json:
        print_json([info.to_json() for info in infos])
        return
    if not infos:
        out.print(f"no keys in {safe_markup(keystore)}")
        return
    rows = [[i.run_id, i.kek_id, i.created_at, i.destroyed_at or "-"] for i in infos]
    print_table(("run", "key id", "created", "destroyed"), rows)


@app.command("destroy")
def destroy(
    keystore: Annotated[str, typer.Option("--keystore", help=KEYSTORE_HELP)],
    run: Annotated[str, typer.Option("--run", help="The run whose key to destroy.")],
    yes: Annotated[bool, typer.Option("--yes", help="Confirm: this cannot be undone.")] = False,
    audit_log: Annotated[Path | None, typer.Option(help="Audit log to record in.")] = None,
    ledger: Annotated[Path | None, typer.Option(help="Ledger holding the audit head.")] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the destroyed key as JSON.")
    ] = False,
) -> None:
    """Destroy a run's key (crypto-erase) and leave a tombstone."""
    if not yes:
        raise UsageError(
            f"destroying the key of run {run!r} makes every generation and copy of it unreadable "
            "forever; pass --yes to confirm"
        )
    trust = TrustContext.configure(
        keystore=open_keystore(keystore), audit_log=audit_log, ledger=ledger, always_audit=True
    )
    info = trust.destroy_run_key(run)
    if as_json:
        print_json(info.to_json())
        return
    out.print(
        f"destroyed key {safe_markup(info.kek_id)} of run {safe_markup(repr(run))}; every "
        "generation of it is now unreadable"
    )
    if info.deleted_after is not None:
        out.print(
            f"the key service deletes the key material after {safe_markup(info.deleted_after)}; "
            "until then it is disabled, and a KMS administrator could still cancel the deletion"
        )


# The options of `ckptvault keys rotate` whose declarations take more than a line, named
# here so that the command's signature reads one option per line.
_RotateStores = Annotated[
    list[str],
    typer.Option(
        "--store",
        help="A store holding generations of the run (repeatable: give every replica; a "
        "copy left out becomes unreadable when the old key is destroyed).",
    ),
]
_SigningKey = Annotated[
    Path | None,
    typer.Option(help="Re-sign the rewritten manifests (required for signed runs)."),
]
_TrustedKeys = Annotated[
    list[Path] | None,
    typer.Option(
        "--trusted-key",
        help="Also accept generations signed by this key before re-signing (repeatable).",
    ),
]
_AbandonUnverified = Annotated[
    bool,
    typer.Option(
        help="Destroy the old key even if some generations fail verification (they become "
        "unreadable)."
    ),
]
_AsJson = Annotated[bool, typer.Option("--json", help="Print a JSON report on stdout.")]


@app.command("rotate")
def rotate(
    # One parameter per command-line option: the declarations are long, the body is steps.
    keystore: Annotated[str, typer.Option("--keystore", help=KEYSTORE_HELP)],
    run: Annotated[str, typer.Option("--run", help="The run whose key to rotate.")],
    store: _RotateStores,
    signing_key: _SigningKey = None,
    trusted_key: _TrustedKeys = None,
    abandon_unverified: _AbandonUnverified = False,
    stop_after: Annotated[int | None, typer.Option(hidden=True)] = None,
    audit_log: Annotated[Path | None, typer.Option(help="Audit log to record in.")] = None,
    ledger: Annotated[Path | None, typer.Option(help="Ledger holding the audit head.")] = None,
    as_json: _AsJson = False,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """Give a run a new key and re-wrap every generation; no tensor file is rewritten.

    Resumable and idempotent: an interrupted rotation is finished by running the same
    command again. Exits 1 when some generation could not be re-wrapped (the old key
    is then kept, so that the run stays readable).
    """
    from ckptvault.ops.rotation.rotate import rotate_run_key

    with progress_bar("re-wrapping generations", "items", as_json=as_json) as bar:
        report = rotate_run_key(
            store,
            run,
            keystore,
            signing_key=signing_key,
            trusted_keys=trusted_key or None,
            ledger=ledger,
            audit_log=audit_log,
            s3=S3Options.from_keywords(endpoint_url=s3_endpoint_url),
            stop_after=stop_after,
            abandon_unverified=abandon_unverified,
            progress=bar,
        )
    if as_json:
        print_json(report.to_json())
    else:
        _print_rotation(report, run)
    if not report.finished:
        raise typer.Exit(1)


def _print_rotation(report: RotationReport, run: str) -> None:
    """The rotation in words: counts, the generations worth a line, and whether the
    retired key is gone or kept."""
    counts = report.counts()
    out.print(
        f"{'resumed' if report.resumed else 'started'} rotation of run "
        f"{safe_markup(repr(run))} to key {safe_markup(report.new_kek_id)}: "
        + ", ".join(f"{n} {name}" for name, n in counts.items() if n)
    )
    for outcome in report.generations:
        if outcome.outcome in (FAILED, NOT_REACHED) or outcome.detail:
            out.print(
                f"  step {outcome.step} ({safe_markup(outcome.generation_id)}) in "
                f"{safe_markup(outcome.store)}: {outcome.outcome} {safe_markup(outcome.detail)}"
            )
    if report.finished:
        retired = ", ".join(report.destroyed_kek_ids) or "none"
        out.print(f"finished: retired key(s) destroyed: {safe_markup(retired)}")
    else:
        out.print(
            "not finished: the retired key is kept so that every generation stays readable; "
            "fix or delete the generations listed, then run this command again"
        )
