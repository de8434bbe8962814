"""``ckptvault consolidate STORE OUT``: a checkpoint's weights as Hugging Face files.

Works on checkpoints saved by any number of ranks: tensors are streamed one at a
time from every rank's files into ``OUT/model.safetensors``, or, past
``--max-shard-size``, into ``model-0000i-of-0000n.safetensors`` files and
``model.safetensors.index.json``. Memory is about the largest tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from ckptvault.cli._common import (
    STORE_HELP,
    AuditLogOption,
    CastDtype,
    KeystoreOption,
    LedgerOption,
    RunIdOption,
    S3EndpointUrl,
    TrustedKeys,
    err,
    human_bytes,
    out,
    safe_markup,
)
from ckptvault.errors import UsageError
from ckptvault.storage import S3Options
from ckptvault.trust.keystore import open_keystore

PROGRESS_THRESHOLD = 64 * 1024 * 1024  # show a bar only when the work is not instant
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})


def parse_size(text: str) -> int:
    """``5GB`` (powers of 1000, as Hugging Face), ``500MiB`` (powers of 1024), or a
    plain byte count; positive. UsageError otherwise."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).upper() if match else ""
    size = int(float(match.group(1)) * _UNITS[unit]) if match and unit in _UNITS else 0
    if size < 1:
        raise UsageError(
            f"--max-shard-size {text[:40]!r} is not a size: give bytes, or a number with "
            "KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024), e.g. 5GB"
        )
    return size


@contextmanager
def progress_bar(what: str) -> Iterator[Callable[[int, int], None]]:
    """A ``progress(done, total)`` callback drawing a transient bar on stderr, on a
    terminal and once the work is large enough to be worth one."""
    with Progress(
        TextColumn(what),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        transient=True,
        disable=not err.is_interactive,
    ) as bar:
        task = None

        def update(done: int, total: int) -> None:
            nonlocal task
            if task is None and total >= PROGRESS_THRESHOLD:
                task = bar.add_task(what, total=total)
            if task is not None:
                bar.update(task, completed=done, total=total)

        yield update


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
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """Write a checkpoint's weights as Hugging Face safetensors files, streamed:
    every byte is verified before it is written; on failure nothing is left (exit 2)."""
    from ckptvault.ops.export import consolidate_weights  # imports torch

    limit = parse_size(max_shard_size)
    with progress_bar(f"consolidating {safe_markup(prefix or 'all tensors')}") as progress:
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
    source, files = result.source, f"{len(result.files)} file(s)"
    out.print(
        f"consolidated {result.tensors} tensors ({human_bytes(result.bytes)}) under "
        f"{safe_markup(repr(prefix))} from step {source.step} ({safe_markup(source.generation_id)})"
        f" into {safe_markup(out_dir)}: {files}{' and an index' if result.index else ''}; "
        f"largest tensor {human_bytes(result.largest)}"
    )
