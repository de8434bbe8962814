"""The :class:`~ckptvault.coordinator.Coordinator` of a torch.distributed job.

Every collective of ckptvault's own (the generation id, per-rank state trees,
verdicts) runs on a dedicated gloo group created with ``collective_timeout_s``, so
that:

- it never queues behind the training job's NCCL work, nor takes part in it;
- a rank that died (SIGKILL, OOM, a lost node) makes the survivors' next collective
  raise after the timeout instead of hanging: gloo enforces the group's timeout.

Values travel as JSON in uint8 tensors: a length first, then the bytes, parsed with
the bounded loader (size, nesting depth) into plain JSON values. Tensor data travels
as raw bytes point to point (:meth:`TorchDistributed.send_tensor`), of a size both
ranks agreed on beforehand, and is checked against digests by its receiver (a
read-once restore: :mod:`ckptvault.distributed.read_once`). Nothing is pickled
and no ``*_object`` collective runs; a rank cannot make another run code, only send
it JSON that is parsed and validated like anything else. A message that is refused
raises :class:`~ckptvault.errors.PeerMessageError`: in a broadcast or an all-gather
on every rank alike (they all received the same bytes), in a gather on rank 0 only,
in a scatter on the rank that received it (their callers keep the ranks in step).
DCP's own collectives are pickled (``gather_object`` and kin), so ckptvault never
runs them: :mod:`ckptvault.distributed.dcp_save` drives DCP's planner over these.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ckptvault.errors import CollectiveError, FormatError, PeerMessageError, UsageError
from ckptvault.format.bounded_json import MAX_DOCUMENT_DEPTH, loads_bounded

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
        buffer = _buffer(data, int(size.item()), "a broadcast")
        self._collective("a broadcast", lambda: dist.broadcast(buffer, src=0, group=self.group))
        decoded: T = _checked(_decode(buffer, 0, "a broadcast"), 0)
        return decoded

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (JSON), in rank order, on every rank."""
        data = _encode(value)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self._world_size)]
        mine = torch.tensor([len(data)], dtype=torch.int64)
        self._collective("an all-gather", lambda: dist.all_gather(sizes, mine, group=self.group))
        # Every rank receives every rank's message padded to the longest: the same
        # bound as a gather's on rank 0, checked alike on every rank (the same sizes).
        lengths = [int(s.item()) for s in sizes]
        longest = max(lengths)
        refused = _refused_size(longest, self._world_size, "an all-gather")
        if refused is not None or min(lengths) < 0:
            rank = lengths.index(min(lengths)) if refused is None else lengths.index(longest)
            raise PeerMessageError(
                f"rank {rank}: {refused or f'a {min(lengths)}-byte message in an all-gather'}; "
                "every rank stops here"
            )
        padded = _buffer(data, longest, "an all-gather", pad=True)
        gathered = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self._world_size)]
        self._collective(
            "an all-gather", lambda: dist.all_gather(gathered, padded, group=self.group)
        )
        return [
            _checked(_decode(buffer[:size], rank, "an all-gather"), rank)
            for rank, (buffer, size) in enumerate(zip(gathered, lengths, strict=True))
        ]

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` (JSON) on rank 0, in rank order; None elsewhere.

        Rank 0 alone receives the messages (a job of 1,024 ranks does not send every
        plan to every rank): the longest length is agreed first (one integer), then
        each rank sends its message framed by its length and padded to that. A
        refused message (not bounded JSON, a frame that lies about its length, over
        the limits) raises ``PeerMessageError`` on rank 0 only, after the collective:
        the caller tells the other ranks in its next collective."""
        data = _encode(value)
        longest = torch.tensor([len(data)], dtype=torch.int64)
        what = "a gather"
        self._collective(
            what,
            lambda: dist.all_reduce(longest, op=dist.ReduceOp.MAX, group=self.group),
        )
        size = int(longest.item())
        refused = _refused_size(size, self._world_size, what)
        if refused is not None:  # every rank sees the same size: none sends the data
            if self.is_coordinator:
                raise PeerMessageError(refused)
            return None
        framed = _framed(data, size)
        received = (
            [torch.zeros(size + _FRAME, dtype=torch.uint8) for _ in range(self._world_size)]
            if self.is_coordinator
            else None
        )
        self._collective(what, lambda: dist.gather(framed, received, dst=0, group=self.group))
        if received is None:
            return None
        return [
            _checked(_decode(_unframed(buffer, size, rank, what), rank, what), rank)
            for rank, buffer in enumerate(received)
        ]

    def scatter(self, values: list[Any] | None) -> Any:
        """Rank 0's ``values[rank]`` (JSON) on each rank; the others pass None.

        The longest length is broadcast first, then each rank receives its own
        framed message (never another rank's). A refused message raises
        ``PeerMessageError`` on the rank that received it."""
        what = "a scatter"
        frames: list[torch.Tensor] | None = None
        longest = torch.zeros(1, dtype=torch.int64)
        if self.is_coordinator:
            if values is None or len(values) != self._world_size:
                raise UsageError(f"scatter on rank 0 needs one value per rank ({self._world_size})")
            encoded = [_encode(value) for value in values]
            longest[0] = max(len(data) for data in encoded)
        self._collective(what, lambda: dist.broadcast(longest, src=0, group=self.group))
        size = int(longest.item())
        refused = _refused_size(size, 1, what)
        if refused is not None:  # every rank sees the same size: none sends the data
            raise PeerMessageError(refused)
        if self.is_coordinator:
            frames = [_framed(data, size) for data in encoded]
        mine = torch.zeros(size + _FRAME, dtype=torch.uint8)
        self._collective(what, lambda: dist.scatter(mine, frames, src=0, group=self.group))
        return _checked(_decode(_unframed(mine, size, 0, what), 0, what), 0)

    def send_tensor(self, tensor: torch.Tensor, destinations: list[int]) -> None:
        """Send the raw bytes of ``tensor`` (a contiguous CPU tensor) to each rank of
        ``destinations`` at once; returns when every one has taken them.

        Point to point on this group, never pickled: each destination calls
        :meth:`receive_tensor` with a buffer of the same size, in the same order of
        transfers as this rank (the caller's schedule keeps the ranks in step). The
        receiver decides what the bytes mean: they are data, checked against digests,
        never code or structure."""
        what = "a tensor transfer"

        def send() -> None:
            works = [dist.isend(tensor, dst, group=self.group) for dst in destinations]
            for work in works:
                if work is not None:  # None: this rank is not in the group (never here)
                    work.wait()

        self._collective(what, send)

    def receive_tensor(self, tensor: torch.Tensor, source: int) -> None:
        """Fill ``tensor`` (contiguous, CPU) with the bytes rank ``source`` sends with
        :meth:`send_tensor`: exactly its size, so a sender cannot make it take more."""
        self._collective("a tensor transfer", lambda: dist.recv(tensor, source, group=self.group))

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
_FRAME = 8  # a gathered or scattered message starts with its length (int64, little-endian)
# What rank 0 holds at once in a gather: the world size times the longest message.
_MAX_GATHERED = 4 * 1024 * 1024 * 1024
# Nesting of a message: a state tree (at most 128 levels) inside a few of its own.
_MAX_DEPTH = MAX_DOCUMENT_DEPTH + 8


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
        raise PeerMessageError(
            f"rank {rank} had a message of {str(value[_OVERSIZED])[:20]} bytes to send, more "
            f"than the {_MAX_MESSAGE} a collective carries; every rank stops here"
        )
    return value


def _refused_size(size: int, senders: int, what: str) -> str | None:
    """Why a collective announced to carry ``senders`` messages of ``size`` bytes
    each must not, or None. Every rank computes it from the same numbers."""
    if not 0 <= size <= _MAX_MESSAGE or senders * (size + _FRAME) > _MAX_GATHERED:
        return (
            f"{what} among the ranks announced messages of {size} bytes from {senders} "
            f"rank(s), over the {_MAX_MESSAGE}-byte limit of a message or the "
            f"{_MAX_GATHERED} bytes one rank receives: refused before any was sent"
        )
    return None


def _buffer(data: bytes, size: int, what: str, pad: bool = False) -> torch.Tensor:
    if size < 0 or size > _MAX_MESSAGE:
        raise PeerMessageError(f"{what}: a rank announced a {size}-byte message: refused")
    buffer = torch.zeros(size, dtype=torch.uint8)
    if data:
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buffer


def _framed(data: bytes, size: int) -> torch.Tensor:
    """``data`` after its length, padded to ``size`` bytes of message."""
    return _buffer(len(data).to_bytes(_FRAME, "little") + data, size + _FRAME, "a frame")


def _unframed(buffer: torch.Tensor, size: int, rank: int, what: str) -> torch.Tensor:
    """The message inside a frame; PeerMessageError when its length lies."""
    length = int.from_bytes(bytes(buffer[:_FRAME].numpy().tobytes()), "little")
    if length > size:
        raise PeerMessageError(
            f"rank {rank} framed a {length}-byte message in {what} of {size}-byte messages: refused"
        )
    return buffer[_FRAME : _FRAME + length]


def _decode(buffer: torch.Tensor, rank: int, what: str) -> Any:
    """The JSON value rank ``rank`` sent, parsed with the bounded loader (size, depth,
    no NaN, no repeated keys) and never anything but JSON."""
    try:
        return loads_bounded(
            buffer.numpy().tobytes(),
            f"the message rank {rank} sent in {what}",
            max_depth=_MAX_DEPTH,
            max_bytes=_MAX_MESSAGE,
        )
    except FormatError as exc:
        raise PeerMessageError(
            f"{exc}; refused, nothing in it was used. A bug or a dishonest rank: check rank "
            f"{rank}'s host and software; every rank stops this save or restore"
        ) from exc


def default_coordinator(timeout_s: float) -> TorchDistributed | None:
    """A :class:`TorchDistributed` when a process group of more than one rank is
    initialized; None otherwise (one process is the whole job)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchDistributed(timeout_s)
    return None
