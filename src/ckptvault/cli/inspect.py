"""``ckptvault inspect DIR [--step N] [--json]``: what a generation holds.

Shows the tensors (dtype, shape, bytes), the JSON leaves of the saved state, the
run contract and the files. Reads the manifest and the files' headers (each checked
against its chunk digests, as restore does); it does not hash the rest of the data
(``ckptvault verify`` does). ``--json`` prints every name whole; so do the tables
when stdout is not a terminal.
"""

from __future__ import annotations

import math
from typing import Annotated, Any

import typer

from ckptvault.cli._common import (
    STORE_HELP,
    S3EndpointUrl,
    human_bytes,
    json_text,
    open_store,
    out,
    print_json,
    print_table,
    safe_markup,
    select,
)
from ckptvault.errors import FormatError
from ckptvault.format.manifest import Manifest
from ckptvault.format.tensorfile import element_size
from ckptvault.trust.checks import check_structure
from ckptvault.trust.problems import GenerationRejected


def inspect(
    directory: Annotated[str, typer.Argument(help=STORE_HELP)],
    step: Annotated[
        int | None, typer.Option(help="Inspect the newest generation of this step.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """Show a generation's tensors, JSON leaves, contract and files."""
    store = open_store(directory, s3_endpoint_url)
    ref = select(store, step, every=False)[0]
    try:
        manifest = check_structure(store, ref).manifest
    except GenerationRejected as rejected:
        raise FormatError(f"cannot inspect {ref.location}: {rejected.reason}") from rejected
    report = _report(manifest, ref.location)
    if as_json:
        print_json(report)
    else:
        _print_report(report)


def _report(manifest: Manifest, location: str) -> dict[str, Any]:
    """Everything ``inspect`` shows, as JSON-able data."""
    tensors = manifest.dcp.get("tensors", {})
    return {
        "generation": {
            "step": manifest.step,
            "generation_id": manifest.generation_id,
            "run_id": manifest.run_id,
            "path": location,
            "created_at": manifest.created_at,
            "parent": manifest.parent,
            "format_version": manifest.format_version,
            "bytes": manifest.stored_bytes,
        },
        "tensors": [
            {
                "key": key,
                "dtype": info["dtype"],
                "shape": info["shape"],
                "bytes": math.prod(info["shape"]) * element_size(info["dtype"]),
            }
            for key, info in sorted(tensors.items())
        ],
        "state": _describe(manifest.state, tensors),
        "contract": manifest.contract,
        "files": {
            name: rec.to_json() | {"chunks": len(rec.chunks)}
            for name, rec in manifest.files.items()
        },
    }


def _print_report(report: dict[str, Any]) -> None:
    # Everything below comes from the manifest, unverified: escaped for the terminal
    # (control characters) and for rich (markup such as "[/bold]").
    gen = report["generation"]
    out.print(
        f"[bold]step {gen['step']}[/bold]  {safe_markup(gen['generation_id'])}  "
        f"run {safe_markup(gen['run_id'])}  {human_bytes(gen['bytes'])}  "
        f"created {safe_markup(gen['created_at'])}"
    )
    print_table(
        ("key", "dtype", "shape", "bytes"),
        (
            (row["key"], row["dtype"], str(row["shape"]), human_bytes(row["bytes"]))
            for row in report["tensors"]
        ),
        right=("bytes",),
        title="tensors",
    )
    out.print("[bold]state[/bold] (tensors shown as <dtype\\[shape]>)")
    out.print(json_text(report["state"]), markup=False, emoji=False)
    out.print("[bold]contract[/bold]")
    out.print(json_text(report["contract"]), markup=False, emoji=False)
    print_table(
        ("name", "size", "blake3"),
        (
            (name, human_bytes(record["size"]), record["blake3"])
            for name, record in sorted(report["files"].items())
        ),
        title="files",
    )


def _describe(value: Any, tensors: dict[str, Any]) -> Any:
    """The tagged state tree with tensor references replaced by a short description."""
    if isinstance(value, list):
        return [_describe(v, tensors) for v in value]
    if isinstance(value, dict):
        if set(value) == {"$tensor"}:
            key = value["$tensor"]
            info = tensors.get(key) if isinstance(key, str) else None
            return f"<{info['dtype']}{info['shape']}>" if info else "<missing tensor>"
        return {k: _describe(v, tensors) for k, v in value.items()}
    return value
