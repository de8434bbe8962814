"""``ManagerConfig``: the manager's plain settings, validated once, up front.

Trust options (keys, ledger, audit log) are not here: they become a
:class:`~ckptvault.trust.context.TrustContext`. Store locations become a store
through :func:`~ckptvault.storage.open_store`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptvault.errors import UsageError
from ckptvault.format.container import DEFAULT_SEGMENT_SIZE, MAX_SEGMENT_SIZE
from ckptvault.format.layout import MAX_STEP
from ckptvault.format.manifest import MAX_CHUNK_SIZE
from ckptvault.trust.digests import DEFAULT_CHUNK_SIZE

IF_BUSY = ("wait", "skip")


def validate_step(step: Any, what: str = "step") -> int:
    """A step is a non-negative int (not a bool)."""
    if not isinstance(step, int) or isinstance(step, bool) or not 0 <= step <= MAX_STEP:
        raise UsageError(f"{what} must be an int in 0..{MAX_STEP}, got {step!r}")
    return step


def resolve_run_id(run_id: str | None, store_location: str, trust: Mapping[str, Any]) -> str:
    """``run_id``, or the store directory's name when no trust feature is on.

    The floor, the signature's run binding and the run's key are all keyed by run id;
    a basename like ``run42`` is shared by ``/expA/run42`` and ``/expB/run42``, so
    with any trust option (``trust``: option name -> value) it must be explicit.
    """
    if run_id is not None:
        return run_id
    name = os.path.basename(store_location)
    given = [option for option, value in trust.items() if value is not None]
    if given:
        raise UsageError(
            f"the default run id, the store directory's name {name!r}, is not unique: "
            "generations of another store with the same name would be accepted (same floor, "
            f"same signer, same run key). With {', '.join(given)} given, pass run_id=... "
            "naming this run uniquely"
        )
    return name


ASYNC_MODES = ("thread", "process")


@dataclass(frozen=True)
class ManagerConfig:
    run_id: str
    contract: Mapping[str, Any] | None = None
    async_save: bool = False
    async_mode: str = "thread"
    max_in_flight: int = 1
    if_busy: str = "wait"
    threads: int = 1
    chunk_size: int = DEFAULT_CHUNK_SIZE
    segment_size: int = DEFAULT_SEGMENT_SIZE
    max_fallback: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.run_id, str) or not self.run_id or len(self.run_id) > 256:
            raise UsageError(
                f"run_id must be a non-empty string of at most 256 characters, got {self.run_id!r}"
            )
        if not (
            0 < self.chunk_size <= MAX_CHUNK_SIZE and 0 < self.segment_size <= MAX_SEGMENT_SIZE
        ):
            raise UsageError(
                f"chunk_size must be in 1..{MAX_CHUNK_SIZE} and segment_size in "
                f"1..{MAX_SEGMENT_SIZE}, got {self.chunk_size}, {self.segment_size}"
            )
        if self.max_in_flight < 1 or self.if_busy not in IF_BUSY:
            raise UsageError(
                f"max_in_flight must be >= 1 and if_busy 'wait' or 'skip', got "
                f"{self.max_in_flight}, {self.if_busy!r}"
            )
        if self.async_mode not in ASYNC_MODES:
            raise UsageError(
                f"async_mode={self.async_mode!r}: give 'thread' (write in a background thread "
                "of this process) or 'process' (in a writer process of its own)"
            )
        if self.threads < 1:
            raise UsageError(f"threads must be >= 1, got {self.threads}")
        fallback = self.max_fallback
        if fallback is not None and (
            not isinstance(fallback, int) or isinstance(fallback, bool) or fallback < 0
        ):
            raise UsageError(
                f"max_fallback must be None (no bound) or an int >= 0, got {fallback!r}; "
                "2 is a good value: restore may skip two damaged newer generations"
            )
