"""``ckptvault ls DIR [--json]``: the store's generations, newest first."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from ckptvault.cli._common import human_bytes, open_store, out, print_json
from ckptvault.storage.listing import list_generation_infos


def ls(
    directory: Annotated[str, typer.Argument(help="The checkpoint store (path or file:// URL).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON list on stdout.")] = False,
) -> None:
    """List generations (step, id, path, size, creation time), newest first."""
    infos = list_generation_infos(open_store(directory))
    if as_json:
        print_json([info.to_json() for info in infos])
        return
    if not infos:
        out.print(f"no generations in {directory}")
        return
    table = Table(box=None, pad_edge=False)
    for column in ("step", "generation id", "created", "size", "path"):
        table.add_column(
            column, justify="right" if column in ("step", "size") else "left", overflow="fold"
        )
    for info in infos:
        table.add_row(
            str(info.step), info.generation_id, info.created_at, human_bytes(info.bytes), info.path
        )
    out.print(table)
