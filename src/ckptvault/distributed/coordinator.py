"""The :class:`~ckptvault.coordinator.Coordinator` of a torch.distributed job.

Every collective of ckptvault's own (the generation id, per-rank state trees,
verdicts) runs on a dedicated gloo group created with ``collective_timeout_s``, so
that:

- it never queues behind the training job's NCCL work, nor takes part in it;
- a rank that died (SIGKILL, OOM, a lost node) makes the survivors' next collective
  raise after the timeout instead of hanging: gloo enforces the group's timeout.

Values travel as canonical JSON in uint8 tensors: a length first, then the bytes.
Nothing is pickled; a rank cannot make another run code, only send it JSON that is
parsed and validated like anything else.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ckptvault.errors import CollectiveError, UsageError

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 600.0
_MAX_MESSAGE = 256 * 1024 * 1024  # what one rank may send in one collective


class TorchDistributed:
    """Rank and world from the default process group; collectives on a gloo group of
    ckptvault's own. Built by the manager when a process group is initialized."""

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError(
                "TorchDistributed needs an initialized process group: call "
                "torch.distributed.init_process_group() first (torchrun sets up the rest)"
            )
        if not timeout_s > 0:
            raise UsageError(f"collective_timeout_s={timeout_s!r}: give a number of seconds > 0")
        self.timeout_s = float(timeout_s)
        self._rank = dist.get_rank()
        self._world_size = dist.get_world_size()
        # Every rank must create it, in the same order: the manager's constructor is
        # itself called on every rank.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def is_coordinator(self) -> bool:
        return self._rank == 0

    @property
    def process_group(self) -> Any:
        return self.group

    def barrier(self) -> None:
        self._collective("a barrier", lambda: dist.barrier(group=self.group))

    def broadcast(self, value: T) -> T:
        """Rank 0's ``value`` on every rank (JSON values)."""
        data = _encode(value) if self.is_coordinator else b""
        size = torch.tensor([len(data)], dtype=torch.int64)
        self._collective("a broadcast", lambda: dist.broadcast(size, src=0, group=self.group))
        buffer = _buffer(data, int(size.item()))
        self._collective("a broadcast", lambda: dist.broadcast(buffer, src=0, group=self.group))
        decoded: T = _checked(_decode(buffer), 0)
        return decoded

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (JSON), in rank order, on every rank."""
        data = _encode(value)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self._world_size)]
        mine = torch.tensor([len(data)], dtype=torch.int64)
        self._collective("an all-gather", lambda: dist.all_gather(sizes, mine, group=self.group))
        longest = max(int(s.item()) for s in sizes)
        padded = _buffer(data, longest, pad=True)
        gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self._world_size)]
        self._collective(
            "an all-gather", lambda: dist.all_gather(gathered, padded, group=self.group)
        )
        return [
            _checked(_decode(buffer[: int(size.item())]), rank)
            for rank, (buffer, size) in enumerate(zip(gathered, sizes, strict=True))
        ]

    def _collective(self, what: str, call: Any) -> None:
        try:
            call()
        except RuntimeError as exc:  # gloo's timeout or a peer's closed connection
            raise CollectiveError(
                f"rank {self._rank}: {what} among {self._world_size} ranks failed "
                f"({' '.join(str(exc).split())[:300]}); another rank died or is stuck. "
                f"ckptvault waits at most collective_timeout_s={self.timeout_s:g} s; nothing "
                "was published by this collective"
            ) from exc

    def __repr__(self) -> str:
        return f"TorchDistributed(rank={self._rank}, world_size={self._world_size})"


_OVERSIZED = "$oversized"


def _encode(value: Any) -> bytes:
    """``value`` as compact JSON; a value over the limit travels as a marker instead,
    so that every rank still takes part in the collective and then raises the same
    error (raising here would leave the other ranks waiting)."""
    data = json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode()
    if len(data) > _MAX_MESSAGE:
        return json.dumps({_OVERSIZED: len(data)}).encode()
    return data


def _checked(value: Any, rank: int) -> Any:
    if isinstance(value, dict) and set(value) == {_OVERSIZED}:
        raise CollectiveError(
            f"rank {rank} had a message of {value[_OVERSIZED]} bytes to send, more than the "
            f"{_MAX_MESSAGE} a collective carries; every rank stops here"
        )
    return value


def _buffer(data: bytes, size: int, pad: bool = False) -> torch.Tensor:
    if size < 0 or size > _MAX_MESSAGE:
        raise CollectiveError(f"a peer announced a {size}-byte message: refused")
    buffer = torch.zeros(size, dtype=torch.uint8)
    if data:
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buffer


def _decode(buffer: torch.Tensor) -> Any:
    try:
        return json.loads(bytes(buffer.numpy().tobytes()).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CollectiveError(f"a peer sent a message that is not JSON: {exc}") from exc


def default_coordinator(timeout_s: float) -> TorchDistributed | None:
    """A :class:`TorchDistributed` when a process group of more than one rank is
    initialized; None otherwise (one process is the whole job)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDistributed(timeout_s)
    return None
