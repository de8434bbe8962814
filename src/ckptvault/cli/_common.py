"""Shared pieces of the command-line tools: consoles, store opening, formatting.

Nothing here imports torch: listing and verifying a store must start fast.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rich.console import Console

from ckptvault.errors import UsageError
from ckptvault.restoring.selector import CandidateSelector
from ckptvault.storage import open_store as _open_store
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.context import TrustContext

out = Console(soft_wrap=True, highlight=False)
err = Console(stderr=True, soft_wrap=True, highlight=False)


def open_store(location: str) -> Store:
    """The store a command reads; an error when nothing is there."""
    return _open_store(location, must_exist=True)


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


def print_json(value: Any) -> None:
    """Pure JSON on stdout, never wrapped or styled, whatever the terminal width."""
    sys.stdout.write(json.dumps(value, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def human_bytes(count: int) -> str:
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{count} B"
