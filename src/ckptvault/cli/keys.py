"""``ckptvault keys ...``: signing keys and per-run encryption keys.

- ``keys generate --private PATH --public PATH``: a new Ed25519 key pair
  (private key written with mode 0600).
- ``keys list --keystore DIR [--json]``: runs, key ids, destroyed keys.
- ``keys destroy --keystore DIR --run RUN --yes``: crypto-erase a run; every
  generation and copy of it becomes unreadable. Recorded in the audit log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ckptvault.cli._common import out, print_json
from ckptvault.errors import UsageError
from ckptvault.trust.context import TrustContext
from ckptvault.trust.keystore import LocalKeyStore
from ckptvault.trust.signing import generate_keypair

app = typer.Typer(help="Signing keys and per-run encryption keys.", no_args_is_help=True)


@app.command("generate")
def generate(
    private: Annotated[
        Path, typer.Option("--private", help="Where to write the private key (0600).")
    ],
    public: Annotated[Path, typer.Option("--public", help="Where to write the public key.")],
) -> None:
    """Generate an Ed25519 signing key pair."""
    out.print(f"generated key {generate_keypair(private, public)}")
    out.print(f"  private: {private} (keep it on the trainer only)")
    out.print(f"  public:  {public} (give it to every verifier)")


@app.command("list")
def list_keys(
    keystore: Annotated[Path, typer.Option("--keystore", help="The key store directory.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
) -> None:
    """List the runs in a key store, their key ids, and destroyed keys."""
    infos = LocalKeyStore(keystore).list_keys()
    if as_json:
        print_json([info.to_json() for info in infos])
        return
    table = Table(box=None, pad_edge=False)
    for column in ("run", "key id", "created", "destroyed"):
        table.add_column(column, overflow="fold")
    for info in infos:
        table.add_row(info.run_id, info.kek_id, info.created_at, info.destroyed_at or "-")
    out.print(table if infos else f"no keys in {keystore}")


@app.command("destroy")
def destroy(
    keystore: Annotated[Path, typer.Option("--keystore", help="The key store directory.")],
    run: Annotated[str, typer.Option("--run", help="The run whose key to destroy.")],
    yes: Annotated[bool, typer.Option("--yes", help="Confirm: this cannot be undone.")] = False,
    audit_log: Annotated[Path | None, typer.Option(help="Audit log to record in.")] = None,
    ledger: Annotated[Path | None, typer.Option(help="Ledger holding the audit head.")] = None,
) -> None:
    """Destroy a run's key (crypto-erase) and leave a tombstone."""
    if not yes:
        raise UsageError(
            f"destroying the key of run {run!r} makes every generation and copy of it unreadable "
            "forever; pass --yes to confirm"
        )
    trust = TrustContext.configure(
        keystore=LocalKeyStore(keystore), audit_log=audit_log, ledger=ledger, always_audit=True
    )
    info = trust.destroy_run_key(run)
    out.print(
        f"destroyed key {info.kek_id} of run {run!r}; every generation of it is now unreadable"
    )
