"""``ManagerConfig``: the manager's plain settings, validated once, up front.

Trust options (keys, ledger, audit log) are not here: they become a
:class:`~ckptvault.trust.context.TrustContext`. Store locations become a store
through :func:`~ckptvault.storage.open_store`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptvault.errors import UsageError
from ckptvault.format.container import DEFAULT_SEGMENT_SIZE
from ckptvault.format.manifest import MAX_CHUNK_SIZE
from ckptvault.trust.digests import DEFAULT_CHUNK_SIZE

IF_BUSY = ("wait", "skip")


@dataclass(frozen=True)
class ManagerConfig:
    run_id: str
    contract: Mapping[str, Any] | None = None
    async_save: bool = False
    max_in_flight: int = 1
    if_busy: str = "wait"
    threads: int = 1
    chunk_size: int = DEFAULT_CHUNK_SIZE
    segment_size: int = DEFAULT_SEGMENT_SIZE

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id or len(self.run_id) > 256:
            raise UsageError(
                f"run_id must be a non-empty string of at most 256 characters, got {self.run_id!r}"
            )
        if not (0 < self.chunk_size <= MAX_CHUNK_SIZE and 0 < self.segment_size <= MAX_CHUNK_SIZE):
            raise UsageError(
                "chunk_size and segment_size must be positive, got "
                f"{self.chunk_size}, {self.segment_size}"
            )
        if self.max_in_flight < 1 or self.if_busy not in IF_BUSY:
            raise UsageError(
                f"max_in_flight must be >= 1 and if_busy 'wait' or 'skip', got "
                f"{self.max_in_flight}, {self.if_busy!r}"
            )
        if self.threads < 1:
            raise UsageError(f"threads must be >= 1, got {self.threads}")
