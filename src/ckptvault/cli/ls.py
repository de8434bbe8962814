"""``ckptvault ls DIR [--json] [--all]``: the store's generations, newest first.

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


def ls(
    directory: Annotated[str, typer.Argument(help=STORE_HELP)],
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list on stdout.")] = False,
    every: Annotated[
        bool, typer.Option("--all", help="Also list generations marked for deletion.")
    ] = False,
    s3_endpoint_url: S3EndpointUrl = None,
) -> None:
    """List generations (step, id, path, size, creation time), newest first."""
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
