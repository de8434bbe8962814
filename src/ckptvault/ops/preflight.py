"""Preflight checks ``ckptvault supervise`` runs before each start of a job."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on the filesystem holding ``path``
    (the nearest existing ancestor when the store does not exist yet)."""
    probe = path.absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    stats = os.statvfs(probe)
    return stats.f_bavail * stats.f_frsize


def free_space_preflight(path: Path, min_free_bytes: int) -> Callable[[], str | None]:
    """A preflight that refuses a start while ``path``'s filesystem has less than
    ``min_free_bytes`` free."""

    def check() -> str | None:
        try:
            available = free_bytes(path)
        except OSError as exc:
            return f"cannot check free space at {path}: {exc}"
        if available < min_free_bytes:
            return (
                f"only {available} bytes free at {path}, --min-free-bytes asks for "
                f"{min_free_bytes}: free space (retention, gc) or lower the minimum"
            )
        return None

    return check
