"""``ckptvault ls DIR [--json] [--all]``: the store's generations, newest first.

``ckptvault ls --tier memory --run-id RUN [--node NODE | --memory-path PATH]``: the
generations a run keeps in this node's memory tier (``CheckpointManager(...,
memory_tier=...)``), its default directory or ``PATH``.

On a terminal the table fits its width; piped or redirected it is plain text, one
line per generation, never wrapped or cut (``--json`` for programs).

Generations retention marked for deletion are left out; ``--all`` shows them with
their mark (since when, and why).
"""

from __future__ import annotations

from typing import Annotated

import typer

from ckptvault.cli._common import (
    STORE_HELP,
    S3EndpointUrl,
    human_bytes,
    open_store,
    out,
    print_json,
    print_table,
    safe_markup,
)
from ckptvault.storage.listing import list_generation_infos

TIERS = ("store", "memory")


def ls(
    directory: Annotated[
        str | None, typer.Argument(help=STORE_HELP + " (not with --tier memory)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list on stdout.")] = False,
    every: Annotated[
        bool, typer.Option("--all", help="Also list generations marked for deletion.")
    ] = False,
    tier: Annotated[
        str, typer.Option("--tier", help="store (DIR), or memory: this node's memory tier.")
    ] = "store",
    run_id: Annotated[
        str | None, typer.Option("--run-id", help="--tier memory: the run whose tier to list.")
    ] = None,
    node: Annotated[
        str | None,
        typer.Option(
            "--node", help="--tier memory: the node (default: this one, or $CKPTVAULT_NODE)."
        ),
    ] = None,
    memory_path: Annotated[
        str | None,
        typer.Option(
            "--memory-path", help="--tier memory: the tier's directory, if not the default."
        ),
    ] = None,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """List generations (step, id, path, size, creation time), newest first."""
    directory = _where(directory, tier, run_id, node, memory_path)
    if directory is None:
        out.print(f"no memory tier of run {safe_markup(run_id or '')} on this node")
        return
    infos = list_generation_infos(open_store(directory, s3_endpoint_url), include_marked=every)
    if as_json:
        print_json([info.to_json() for info in infos])
        return
    if not infos:
        out.print(f"no generations in {safe_markup(directory)}")
        return
    columns = ["step", "generation id", "created", "size", "path"]
    if every:
        columns.append("marked for deletion")
    rows = []
    for info in infos:
        row = [
            str(info.step),
            info.generation_id,
            info.created_at,
            human_bytes(info.bytes),
            info.path,
        ]
        if every:
            row.append(f"since {info.marked_at}: {info.mark_reason}" if info.marked_at else "")
        rows.append(row)
    # Names, times and deletion marks are read from the store: print_table escapes them.
    print_table(columns, rows, right=("step", "size"))


def _where(
    directory: str | None,
    tier: str,
    run_id: str | None,
    node: str | None,
    memory_path: str | None,
) -> str | None:
    """The directory to list; None for a memory tier that does not exist here."""
    if tier not in TIERS:
        raise typer.BadParameter(f"--tier must be one of {', '.join(TIERS)}, not {tier!r}")
    if tier == "store":
        if directory is None:
            raise typer.BadParameter("give the store's DIR (or --tier memory --run-id RUN)")
        return directory
    from pathlib import Path

    from ckptvault.memory.tier import default_directory, existing_directory

    if directory is not None:
        raise typer.BadParameter("--tier memory lists a run's memory tier: give --run-id, no DIR")
    if memory_path is None and run_id is None:
        raise typer.BadParameter("--tier memory needs --run-id RUN (or --memory-path PATH)")
    path = Path(memory_path) if memory_path else default_directory(str(run_id), node)
    found = existing_directory(path)
    return str(found) if found is not None else None
