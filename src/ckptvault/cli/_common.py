"""Shared pieces of the command-line tools: consoles, store opening, formatting.

Nothing here imports torch: listing and verifying a store must start fast.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from ckptvault.errors import UsageError
from ckptvault.storage.base import GenerationRef
from ckptvault.storage.posix import PosixStore

out = Console(soft_wrap=True, highlight=False)
err = Console(stderr=True, soft_wrap=True, highlight=False)


def open_store(directory: Path) -> PosixStore:
    if not directory.exists():
        raise UsageError(f"no checkpoint store at {directory} (the directory does not exist)")
    if not directory.is_dir():
        raise UsageError(f"{directory} is not a directory")
    return PosixStore(directory)


def select(store: PosixStore, step: int | None, every: bool) -> list[GenerationRef]:
    """The generations a command acts on: the newest, those of ``step``, or all."""
    refs = store.list_generations()
    if not refs:
        raise UsageError(f"store {store.location} holds no generations")
    if step is not None:
        chosen = [ref for ref in refs if ref.step == step]
        if not chosen:
            raise UsageError(f"store {store.location} has no generation of step {step}")
        return chosen
    return refs if every else refs[:1]


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
