"""``ckptvault export`` and ``ckptvault verify-export``: weights-only safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ckptvault.cli._common import (
    STORE_HELP,
    AuditLogOption,
    CastDtype,
    KeystoreOption,
    LedgerOption,
    RunIdOption,
    S3EndpointUrl,
    TrustedKeys,
    human_bytes,
    out,
    print_json,
    safe_markup,
)
from ckptvault.cli._progress import progress_bar
from ckptvault.storage import S3Options
from ckptvault.trust.keystores import open_keystore

if TYPE_CHECKING:
    from ckptvault.ops.export import ExportResult  # imports torch

AsJson = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]


def export(
    store: Annotated[str, typer.Argument(help=STORE_HELP)],
    out_path: Annotated[Path, typer.Option("--out", help="The safetensors file to write.")],
    step: Annotated[
        int | None,
        typer.Option(help="The step to export (default: the newest step that verifies)."),
    ] = None,
    key: Annotated[str, typer.Option(help="The state entry to export.")] = "model",
    dtype: CastDtype = None,
    signing_key: Annotated[
        Path | None,
        typer.Option(help="Sign an export manifest with this key (needs --trusted-key)."),
    ] = None,
    trusted_key: TrustedKeys = None,
    keystore: KeystoreOption = None,
    run_id: RunIdOption = None,
    audit_log: AuditLogOption = None,
    ledger: LedgerOption = None,
    as_json: AsJson = False,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """Write the tensors of one state entry, and nothing else, as safetensors.

    Streamed one tensor at a time, from checkpoints saved by any number of ranks.

    --signing-key needs --trusted-key: a signed export vouches for its source, so the
    source generation's signature is verified first (exit 2 otherwise, nothing written).
    """
    from ckptvault.ops.export import export_weights  # imports torch

    with progress_bar(f"exporting {safe_markup(repr(key))}", as_json=as_json) as progress:
        result = export_weights(
            store,
            step,
            out_path,
            key=key,
            dtype=dtype,
            run_id=run_id,
            signing_key=signing_key,
            trusted_keys=trusted_key or None,
            keystore=open_keystore(keystore) if keystore else None,
            audit_log=audit_log,
            ledger=ledger,
            s3=S3Options.from_keywords(endpoint_url=s3_endpoint_url),
            progress=progress,
        )
    if as_json:
        print_json(_export_json(result, key))
        return
    out.print(
        f"exported {result.tensors} tensors ({human_bytes(result.bytes)}) of "
        f"{safe_markup(repr(key))} from step {result.step} "
        f"({safe_markup(result.generation_id)}) to {safe_markup(result.path)}"
    )
    if result.manifest_path is not None:
        out.print(f"signed export manifest: {safe_markup(result.manifest_path)}")


def _export_json(result: ExportResult, key: str) -> dict[str, Any]:
    """What ``export --json`` prints: the file written and the generation it came from."""
    return {
        "path": str(result.path),
        "key": key,
        "tensors": result.tensors,
        "bytes": result.bytes,
        "blake3": result.blake3,
        "run_id": result.run_id,
        "step": result.step,
        "generation_id": result.generation_id,
        "manifest_path": str(result.manifest_path) if result.manifest_path else None,
    }


def verify_export(
    file: Annotated[Path, typer.Argument(help="The exported safetensors file.")],
    trusted_key: Annotated[
        list[Path], typer.Option("--trusted-key", help="A trusted public key (repeatable).")
    ],
    as_json: AsJson = False,
) -> None:
    """Check an export's signed manifest and that the file matches it (exit 2 when
    it does not: the reason is printed)."""
    from ckptvault.ops.export_manifest import verify_export as check

    result = check(file, trusted_key)
    source = result.source
    if as_json:
        print_json(
            {
                "path": str(file),
                "ok": True,
                "signer": result.signer,
                "blake3": result.blake3,
                "source": source,
            }
        )
        return
    out.print(
        f"[green]OK[/green] {safe_markup(file)} signed by {safe_markup(result.signer)}: run "
        f"{safe_markup(repr(source['run_id']))}, step {safe_markup(source['step'])}, "
        f"generation {safe_markup(source['generation_id'])}"
    )
