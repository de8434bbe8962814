"""Files between nodes over the coordinator's process group, as bytes (never pickle).

Every rank computes the same list of transfers (who sends which file, of which
size, to whom) from JSON every rank received alike, and walks it in order, taking
part in the transfers it sends or receives. Since all go through one order, the
earliest unfinished transfer always has both its ranks at it: no rank waits on a
transfer whose partner waits on another. A receiver takes exactly the size agreed
(in chunks of :data:`CHUNK` bytes), so a sender cannot make it take more; what it
received is checked against the manifest before anything is applied, as every
byte of a generation is.

A rank that cannot read a file it sends, or write one it receives (a full tmpfs, a
file gone), still takes its full part in that transfer, sending zeros or discarding
what arrives, and raises once the whole plan is done: a failed file costs that copy,
never a partner left waiting for bytes until the group's timeout. Only the process
group failing (a rank died) ends the walk at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import IO, Any, NamedTuple

import torch

from ckptvault.errors import CheckpointError, PeerMessageError

CHUNK = 64 << 20


class Transfer(NamedTuple):
    """``src`` sends the file ``name`` of ``size`` bytes to ``dst`` (global ranks)."""

    src: int
    dst: int
    name: str
    size: int


def run_transfers(
    plan: Sequence[Transfer],
    rank: int,
    group: Any,
    read: Callable[[str], IO[bytes]],
    write: Callable[[str], Any],
) -> None:
    """Take part in ``plan`` as ``rank``: ``read(name)`` opens a file to send,
    ``write(name)`` a sink to receive into (``write``/``commit``/``abort``). The
    first file this rank could not read or write is raised after the whole plan
    (see the module docstring)."""
    failures: list[Exception] = []
    for item in plan:
        if item.src == rank == item.dst:
            raise PeerMessageError(f"transfer of {item.name} from rank {rank} to itself")
        if item.src == rank:
            _send(item, group, read, failures)
        elif item.dst == rank:
            _receive(item, group, write, failures)
    if failures:
        raise failures[0]


def _send(
    item: Transfer, group: Any, read: Callable[[str], IO[bytes]], failures: list[Exception]
) -> None:
    """Exactly ``item.size`` bytes to ``item.dst``: the file's, then zeros if it could
    not be read to the size agreed."""
    import torch.distributed as dist

    source: IO[bytes] | None = None
    try:
        source = read(item.name)
    except (OSError, CheckpointError) as exc:
        failures.append(exc)
    try:
        left = item.size
        while left:
            want = min(CHUNK, left)
            data = b""
            if source is not None:
                try:
                    data = source.read(want)
                except (OSError, CheckpointError) as exc:
                    failures.append(exc)
                if not data:
                    if not failures:
                        failures.append(
                            PeerMessageError(
                                f"{item.name} is shorter than the {item.size} bytes agreed"
                            )
                        )
                    source.close()
                    source = None
            if not data:
                data = bytes(want)  # the partner still takes the size agreed
            left -= len(data)
            dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), item.dst, group)
    finally:
        if source is not None:
            source.close()


def _receive(
    item: Transfer, group: Any, write: Callable[[str], Any], failures: list[Exception]
) -> None:
    """Exactly ``item.size`` bytes from ``item.src``, into ``write(item.name)`` while it
    takes them, discarded once it failed."""
    import torch.distributed as dist

    sink = None
    try:
        sink = write(item.name)
    except (OSError, CheckpointError) as exc:
        failures.append(exc)
    try:
        left = item.size
        while left:
            buffer = torch.empty(min(CHUNK, left), dtype=torch.uint8)
            dist.recv(buffer, item.src, group)
            left -= buffer.numel()
            if sink is not None:
                try:
                    sink.write(buffer.numpy().tobytes())
                except (OSError, CheckpointError) as exc:
                    failures.append(exc)
                    sink.abort()
                    sink = None
        if sink is not None:
            try:
                sink.commit()
            except (OSError, CheckpointError) as exc:
                failures.append(exc)
                sink.abort()
            sink = None
    finally:
        if sink is not None:  # the process group failed: nothing more arrives
            sink.abort()


def file_sizes(directory: str, names: Sequence[str]) -> dict[str, int]:
    """The sizes of ``names`` in ``directory`` (plain files only)."""
    sizes = {}
    for name in names:
        info = os.lstat(os.path.join(directory, name))
        if not os.path.isfile(os.path.join(directory, name)) or os.path.islink(
            os.path.join(directory, name)
        ):
            raise PeerMessageError(f"{name} in {directory} is not a plain file")
        sizes[name] = info.st_size
    return sizes
