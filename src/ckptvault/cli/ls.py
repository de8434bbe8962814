"""``ckptvault ls DIR [--json] [--all]``: the store's generations, newest first.

``ckptvault ls --tier memory --run-id RUN [--node NODE | --memory-path PATH]``: the
generations a run keeps in this node's memory tier (``CheckpointManager(...,
memory_tier=...)``), its default directory or ``PATH``.

On a terminal the table fits its width; piped or redirected it is plain text, one
line per generation, never wrapped or cut (``--json`` for programs).

Generations retention marked for deletion are left out; ``--all`` shows them with
their mark (since when, and why).

An empty store prints "no generations in DIR" (``[]`` with ``--json``), exit 0. A
local folder with no generation of its own whose subfolders are stores (``ls runs``
for ``ls runs/run42``) is an error, exit 2, naming those stores.
"""

from __future__ import annotations

import itertools
import os
from typing import Annotated
from urllib.parse import unquote, urlsplit

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
from ckptvault.errors import UsageError
from ckptvault.format.layout import parse_generation_dirname
from ckptvault.storage.listing import list_generation_infos

TIERS = ("store", "memory")
_STORES_SHOWN = 5  # stores named in the error for a folder of stores


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
        if not infos:
            _refuse_a_folder_of_stores(directory)
        print_json([info.to_json() for info in infos])
        return
    if not infos:
        _nothing_listed(directory, as_json)
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


def _nothing_listed(directory: str, as_json: bool) -> None:
    _refuse_a_folder_of_stores(directory)
    out.print(f"no generations in {safe_markup(directory)}")


def _refuse_a_folder_of_stores(directory: str) -> None:
    """A local folder that holds no generation but holds stores is not what the user
    meant to list (``ls runs/`` for ``ls runs/run42``): a UsageError (exit 2) naming
    the stores, rather than an empty listing that reads as "no checkpoints"."""
    stores = stores_within(directory)
    if stores:
        shown = ", ".join(stores[:_STORES_SHOWN])
        more = f" and {len(stores) - _STORES_SHOWN} more" if len(stores) > _STORES_SHOWN else ""
        raise UsageError(
            f"{directory} is not a store but holds {len(stores)} store(s): {shown}{more}; "
            f"list one of them: ckptvault ls {os.path.join(directory, stores[0])}"
        )


def stores_within(directory: str, limit: int = 10_000) -> list[str]:
    """The names of the subdirectories of a local ``directory`` that hold at least one
    generation (sorted); empty for a remote store or a folder that cannot be read.
    Links are not followed, and at most ``limit`` entries of each folder are looked
    at: a folder of any size costs a bounded scan."""
    if "://" in directory and not directory.startswith("file://"):
        return []
    path = unquote(urlsplit(directory).path) if directory.startswith("file://") else directory
    found = []
    try:
        with os.scandir(path) as entries:
            for entry in itertools.islice(entries, limit):
                if entry.is_dir(follow_symlinks=False) and _holds_generations(entry.path, limit):
                    found.append(entry.name)
    except OSError:
        return []
    return sorted(found)


def _holds_generations(path: str, limit: int) -> bool:
    try:
        with os.scandir(path) as entries:
            return any(
                parse_generation_dirname(entry.name) is not None
                for entry in itertools.islice(entries, limit)
            )
    except OSError:
        return False


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
