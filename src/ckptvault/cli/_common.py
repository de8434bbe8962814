"""Shared pieces of the command-line tools: consoles, store opening, formatting.

Nothing here imports torch: listing and verifying a store must start fast.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ckptvault.errors import UsageError
from ckptvault.restoring.selector import CandidateSelector
from ckptvault.storage import S3Options
from ckptvault.storage import open_store as _open_store
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.context import TrustContext

out = Console(soft_wrap=True, highlight=False)
err = Console(stderr=True, soft_wrap=True, highlight=False)


# Every command that takes a store takes this too; boto3 also reads AWS_ENDPOINT_URL.
S3EndpointUrl = Annotated[
    str | None,
    typer.Option(
        "--s3-endpoint-url",
        help="S3-compatible endpoint for s3:// stores (default: boto3's configuration, "
        "e.g. AWS_ENDPOINT_URL).",
    ),
]
STORE_HELP = (
    "The checkpoint store (path, file://, s3://bucket/prefix or az://container/prefix URL; "
    "az:// takes its account from AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_URL)."
)

# Options that export and consolidate share: the trust they read the checkpoint with.
CastDtype = Annotated[
    str | None, typer.Option("--dtype", help="Cast floating-point tensors: bf16, fp16 or fp32.")
]
TrustedKeys = Annotated[
    list[Path] | None,
    typer.Option(
        "--trusted-key", help="Require the checkpoint be signed by this key (repeatable)."
    ),
]
KeystoreOption = Annotated[
    str | None,
    typer.Option("--keystore", help="Key store of an encrypted run (a directory or a kms:// URL)."),
]
RunIdOption = Annotated[str | None, typer.Option("--run-id", help="Require this run id.")]
AuditLogOption = Annotated[Path | None, typer.Option("--audit-log", help="Audit log to record in.")]
LedgerOption = Annotated[
    Path | None, typer.Option("--ledger", help="Ledger of abandoned generations.")
]


# Commands that read the catalog (catalog, status): which one.
CatalogLedgerOption = Annotated[
    Path | None, typer.Option("--ledger", help="Read the catalog beside this ledger.")
]
CatalogPathOption = Annotated[
    Path | None, typer.Option("--catalog", help="Read this catalog file.")
]


def catalog_file(ledger: Path | None, catalog: Path | None, required: bool) -> Path | None:
    """The catalog a command reads: ``catalog``, the one beside ``ledger``, or the
    default one. One named explicitly (or any, when ``required``) must exist; else
    None when the default one does not."""
    from ckptvault.observe.catalog import default_catalog_path
    from ckptvault.trust.ledger import default_ledger_path

    if ledger is not None and catalog is not None:
        raise UsageError("give --ledger or --catalog, not both")
    path = catalog or default_catalog_path(ledger or default_ledger_path())
    if path.is_file():
        return path
    if required or catalog is not None or ledger is not None:
        raise UsageError(
            f"no catalog at {path}: a CheckpointManager writes it (its catalog option; "
            "default beside the ledger) once it saved or restored; give --catalog PATH, or "
            "--ledger PATH for the one beside a ledger"
        )
    return None


def open_store(location: str, s3_endpoint_url: str | None = None) -> Store:
    """The store a command reads; an error when nothing is there."""
    s3 = S3Options.from_keywords(endpoint_url=s3_endpoint_url)
    return _open_store(location, must_exist=True, s3=s3)


def select(
    store: Store, step: int | None, every: bool, trust: TrustContext | None = None
) -> list[GenerationRef]:
    """The generations a command acts on: the newest, those of ``step``, or all."""
    selection = CandidateSelector(store, None, trust or TrustContext()).select(step)
    if not selection.candidates:
        raise UsageError(f"store {store.location} holds no generations")
    if every or step is not None:
        return selection.candidates
    return selection.candidates[:1]


# Characters a terminal acts on or that change what is shown: C0 and C1 controls
# (ESC starts escape sequences, BEL, CR, backspace), DEL, line and paragraph
# separators, bidirectional overrides; and lone surrogates, which are not text.
_UNSAFE_BEYOND_C0 = "\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE_TEXT = re.compile(f"[\x00-\x1f{_UNSAFE_BEYOND_C0}]")
_UNSAFE_IN_JSON = re.compile(f"[{_UNSAFE_BEYOND_C0}]")  # json.dumps escapes C0 itself


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe_text(value: object) -> str:
    """``value`` as text that is safe on a terminal: every control character (and
    every other character listed above) shown as a ``\\xNN``/``\\uNNNN`` escape.
    For any string that came from the store (run ids, key ids, reasons, names)."""
    return _UNSAFE_TEXT.sub(_escaped, str(value))


def safe_markup(value: object) -> str:
    """:func:`safe_text` with rich markup escaped: for store-derived strings placed
    inside a string printed with markup, or in a table cell."""
    return escape(safe_text(value))


def json_text(value: Any, indent: int | None = 2) -> str:
    """Exact JSON whose text is safe on a terminal: what :func:`safe_text` escapes is
    written as JSON ``\\uNNNN`` escapes (the same value), never raw."""
    text = json.dumps(value, indent=indent, ensure_ascii=False)
    return _UNSAFE_IN_JSON.sub(lambda match: f"\\u{ord(match.group()):04x}", text)


def print_json(value: Any) -> None:
    """Pure JSON on stdout, never wrapped or styled, whatever the terminal width."""
    sys.stdout.write(json_text(value) + "\n")
    sys.stdout.flush()


def print_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[str]],
    *,
    right: Collection[str] = (),
    title: str | None = None,
    header: bool = True,
    styles: Mapping[str, Mapping[str, str]] | None = None,
) -> None:
    """A table on stdout; its cells are plain text (escaped here: they quote the store).

    The one way every command prints a table. On a terminal, rich's table, fitted to
    its width (long cells folded). Anywhere else (a pipe, a file, a log) plain text: the
    title, a header line (unless ``header`` is false), then one line per row, columns
    padded with spaces and separated by two, never wrapped or cut whatever the width
    or ``COLUMNS``, so that ``grep``, ``awk`` and ``cut`` read every name whole.
    ``right`` names the columns aligned right (numbers). ``styles`` colours cells on a
    terminal only: column -> cell text -> rich style (``{"status": {"fail": "red"}}``)."""
    table_rows = [list(row) for row in rows]
    if out.is_terminal:
        _rich_table(columns, table_rows, right, title, header, styles or {})
        return
    lines = [list(columns)] if header else []
    lines += [[safe_text(cell) for cell in row] for row in table_rows]
    widths = [max((len(line[i]) for line in lines), default=0) for i in range(len(columns))]
    text = [safe_text(title)] if title else []
    for line in lines:
        cells = (
            cell.rjust(width) if column in right else cell.ljust(width)
            for cell, width, column in zip(line, widths, columns, strict=True)
        )
        text.append("  ".join(cells).rstrip())
    sys.stdout.write("\n".join(text) + "\n")
    sys.stdout.flush()


def _rich_table(
    columns: Sequence[str],
    rows: list[list[str]],
    right: Collection[str],
    title: str | None,
    header: bool,
    styles: Mapping[str, Mapping[str, str]],
) -> None:
    table = Table(
        box=None,
        pad_edge=False,
        title=safe_markup(title) if title else None,
        title_justify="left",
        show_header=header,
    )
    for column in columns:
        justify: Literal["left", "right"] = "right" if column in right else "left"
        table.add_column(column, justify=justify, overflow="fold")
    for row in rows:
        cells = []
        for column, cell in zip(columns, row, strict=True):
            style = styles.get(column, {}).get(cell)
            text = safe_markup(cell)
            cells.append(f"[{style}]{text}[/]" if style else text)
        table.add_row(*cells)
    out.print(table)


def human_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{count} B"
