"""``ckptvault consolidate STORE OUT``: a checkpoint's weights as Hugging Face files.

Works on checkpoints saved by any number of ranks: tensors are streamed one at a
time from every rank's files into ``OUT/model.safetensors``, or, past
``--max-shard-size``, into ``model-0000i-of-0000n.safetensors`` files and
``model.safetensors.index.json``. Memory is about the largest tensor.
"""

from __future__ import annotations

import re
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
from ckptvault.errors import UsageError
from ckptvault.storage import S3Options
from ckptvault.trust.keystores import open_keystore

if TYPE_CHECKING:
    from ckptvault.ops.export import ConsolidateResult  # imports torch

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})


def parse_size(text: str, option: str = "--max-shard-size") -> int:
    """``5GB`` (powers of 1000, as Hugging Face), ``500MiB`` (powers of 1024), or a
    plain byte count; positive. UsageError (naming ``option``) otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    size = int(float(match.group(1)) * _UNITS[unit]) if match and unit in _UNITS else 0
    if size < 1:
        raise UsageError(
            f"{option} {text[:40]!r} is not a size: give bytes, or a number with "
            "KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024), e.g. 5GB"
        )
    return size


def consolidate(
    store: Annotated[str, typer.Argument(help=STORE_HELP)],
    out_dir: Annotated[Path, typer.Argument(help="The directory to write the files into.")],
    step: Annotated[
        int | None, typer.Option(help="The step to consolidate (default: the newest).")
    ] = None,
    prefix: Annotated[
        str, typer.Option(help="Consolidate the tensors whose keys start with this.")
    ] = "model/",
    max_shard_size: Annotated[
        str, typer.Option(help="Largest file, e.g. 5GB or 500MiB; larger models are sharded.")
    ] = "5GB",
    dtype: CastDtype = None,
    trusted_key: TrustedKeys = None,
    keystore: KeystoreOption = None,
    run_id: RunIdOption = None,
    audit_log: AuditLogOption = None,
    ledger: LedgerOption = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print what was written as JSON on stdout.")
    ] = False,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """Write a checkpoint's weights as Hugging Face safetensors files, streamed:
    every byte is verified before it is written; on failure nothing is left (exit 2)."""
    from ckptvault.ops.export import consolidate_weights  # imports torch

    limit = parse_size(max_shard_size)
    what = f"consolidating {safe_markup(prefix or 'all tensors')}"
    with progress_bar(what, as_json=as_json) as progress:
        result = consolidate_weights(
            store,
            out_dir,
            step=step,
            prefix=prefix,
            max_shard_size=limit,
            dtype=dtype,
            run_id=run_id,
            trusted_keys=trusted_key or None,
            keystore=open_keystore(keystore) if keystore else None,
            audit_log=audit_log,
            ledger=ledger,
            s3=S3Options.from_keywords(endpoint_url=s3_endpoint_url),
            progress=progress,
        )
    if as_json:
        print_json(_result_json(result, prefix))
        return
    source, files = result.source, f"{len(result.files)} file(s)"
    out.print(
        f"consolidated {result.tensors} tensors ({human_bytes(result.bytes)}) under "
        f"{safe_markup(repr(prefix))} from step {source.step} ({safe_markup(source.generation_id)})"
        f" into {safe_markup(out_dir)}: {files}{' and an index' if result.index else ''}; "
        f"largest tensor {human_bytes(result.largest)}"
    )


def _result_json(result: ConsolidateResult, prefix: str) -> dict[str, Any]:
    """What ``--json`` prints: the source generation and every file written."""
    source = result.source
    return {
        "run_id": source.run_id,
        "step": source.step,
        "generation_id": source.generation_id,
        "prefix": prefix,
        "tensors": result.tensors,
        "bytes": result.bytes,
        "largest_tensor_bytes": result.largest,
        "files": [str(path) for path in result.files],
        "index": str(result.index) if result.index else None,
    }
