"""The memory tier's settings, the node a process runs on, and its directory.

A node's identity is its host name; ``CKPTVAULT_NODE`` overrides it, so that one
machine can stand in for several nodes in tests and drills. The tier's directory is
node-local: by default ``/dev/shm/ckptvault-<uid>/<run id>/<node>``. Whoever can
write there could plant generations, so it is created ``0700`` and every existing
component below the base is checked: a real directory (not a link), owned by this
user, writable by no one else.
"""

from __future__ import annotations

import os
import re
import secrets
import socket
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptvault.errors import UsageError

__all__ = [
    "MemoryTier",
    "default_directory",
    "existing_directory",
    "node_name",
    "tier_directory",
]

NODE_ENV = "CKPTVAULT_NODE"
DEFAULT_BASE = Path("/dev/shm")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")


@dataclass(frozen=True)
class MemoryTier:
    """A memory tier for ``CheckpointManager(..., memory_tier=MemoryTier(...))``.

    ``path``: the node-local directory (on tmpfs); None for
    ``/dev/shm/ckptvault-<uid>/<run id>/<node>``. ``peers``: other nodes that keep a
    copy of each generation besides rank 0's (a job on one node has none). ``keep``: newest
    generations kept in memory (and, as retention always keeps one, an older verified
    fallback). ``durable_every``: every that-many-th save also goes
    to the store (and its tiers); the others live in memory only."""

    path: str | os.PathLike[str] | None = None
    peers: int = 1
    keep: int = 1
    durable_every: int = 5

    def __post_init__(self) -> None:
        for name in ("peers", "keep", "durable_every"):
            value = getattr(self, name)
            low = 0 if name == "peers" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise UsageError(f"MemoryTier({name}=...) must be an int >= {low}, got {value!r}")


def node_name() -> str:
    """This process's node: ``$CKPTVAULT_NODE``, else the host name."""
    name = os.environ.get(NODE_ENV) or socket.gethostname()
    if not _NAME.match(name):
        raise UsageError(
            f"node name {name[:80]!r} (from ${NODE_ENV} or the host name) must be 1-128 "
            "letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


def default_directory(run_id: str, node: str | None = None) -> Path:
    """Where a run's memory tier lives on ``node`` (default: this one) when
    ``MemoryTier(path=None)``; nothing is created."""
    node = node or node_name()
    for what, name in (("run id", run_id), ("node", node)):
        if not _NAME.match(name):
            raise UsageError(f"{what} {name[:80]!r} is not a name a memory tier's path holds")
    return DEFAULT_BASE / f"ckptvault-{os.geteuid()}" / run_id / node


def existing_directory(path: Path) -> Path | None:
    """``path`` if it is a memory tier's directory as :func:`tier_directory` leaves
    one (refused otherwise, as there); None when there is none. Nothing is created."""
    if not os.path.lexists(path):
        return None
    _check_private(path)
    return path


def tier_directory(tier: MemoryTier, run_id: str) -> Path:
    """The tier's directory on this node, created ``0700`` and checked (see the
    module docstring)."""
    if tier.path is not None:
        base, parts = Path(tier.path), []
    else:
        base = DEFAULT_BASE
        parts = [f"ckptvault-{os.geteuid()}", run_id, node_name()]
    if not base.is_absolute():
        base = Path.cwd() / base
    path = base
    for part in parts:
        path = path / part
        _make_private(path)
    if not parts:  # the caller's own directory: its parents as they are, or made private
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        _make_private(path)
    return path


def _make_private(path: Path) -> None:
    """``path`` as a directory of ours that no one else can write: made ``0700`` if
    absent; refused if it is a link, not a directory, another user's, or writable
    by group or others."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise UsageError(
            f"cannot create the memory tier's directory {path}: {exc.strerror}; give "
            "MemoryTier(path=...) a directory on tmpfs this user can write"
        ) from exc
    _check_private(path)


def _check_private(path: Path) -> None:
    info = os.lstat(path)
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = "is a symbolic link"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory"
    elif info.st_uid != os.geteuid():
        problem = f"belongs to uid {info.st_uid}, not to this user ({os.geteuid()})"
    elif info.st_mode & 0o022:
        problem = f"is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    if problem is not None:
        raise UsageError(
            f"the memory tier's directory {path} {problem}: anyone who can write there "
            "can plant generations. Remove it, or give MemoryTier(path=...) a private one"
        )


def check_shared_directories(directory: Path, nodes: list[str], coordinator: Any) -> None:
    """Collective: the ranks that name one node must share ``directory`` (two hosts
    under one name, e.g. both ``localhost``, would each keep half of every
    generation). Each rank leaves a marker there and looks for its node-mates';
    every rank raises the same ``UsageError`` when any is missing."""
    rank = coordinator.rank
    token = secrets.token_hex(8)
    marker = directory / f".node-check-{rank}-{token}"
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    os.close(fd)
    try:
        tokens = [str(t) for t in coordinator.all_gather(token)]
        unseen = [
            other
            for other, (name, its) in enumerate(zip(nodes, tokens, strict=True))
            if name == nodes[rank] and not (directory / f".node-check-{other}-{its}").exists()
        ]
        verdicts = coordinator.all_gather(unseen)
    finally:
        coordinator.barrier()
        marker.unlink(missing_ok=True)
    split = [(r, v) for r, v in enumerate(verdicts) if v]
    if split:
        rank_seen, missing = split[0]
        raise UsageError(
            f"ranks {sorted({rank_seen, *missing})} say they run on node "
            f"{nodes[rank_seen]!r} but do not share its memory tier's directory: two machines "
            f"use one node name (set {NODE_ENV} to a name of each machine's own), or "
            "MemoryTier(path=...) differs between ranks of one node"
        )
