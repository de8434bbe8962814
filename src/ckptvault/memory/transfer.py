"""Files between nodes over the coordinator's process group, as bytes (never pickle).

Every rank computes the same list of transfers (who sends which file, of which
size, to whom) from JSON every rank received alike, and walks it in order, taking
part in the transfers it sends or receives. Since all go through one order, the
earliest unfinished transfer always has both its ranks at it: no rank waits on a
transfer whose partner waits on another. A receiver takes exactly the size agreed
(in chunks of :data:`CHUNK` bytes), so a sender cannot make it take more; what it
received is checked against the manifest before anything is applied, as every
byte of a generation is.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import IO, Any, NamedTuple

import torch

from ckptvault.errors import PeerMessageError

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
    ``write(name)`` a sink to receive into (``write``/``commit``/``abort``)."""
    import torch.distributed as dist

    for item in plan:
        if item.src == rank == item.dst:
            raise PeerMessageError(f"transfer of {item.name} from rank {rank} to itself")
        if item.src == rank:
            with read(item.name) as source:
                left = item.size
                while left:
                    data = source.read(min(CHUNK, left))
                    if not data:
                        raise PeerMessageError(
                            f"{item.name} is shorter than the {item.size} bytes agreed"
                        )
                    left -= len(data)
                    dist.send(torch.frombuffer(bytearray(data), dtype=torch.uint8), item.dst, group)
        elif item.dst == rank:
            sink = write(item.name)
            try:
                left = item.size
                while left:
                    buffer = torch.empty(min(CHUNK, left), dtype=torch.uint8)
                    dist.recv(buffer, item.src, group)
                    sink.write(buffer.numpy().tobytes())
                    left -= buffer.numel()
                sink.commit()
            except BaseException:
                sink.abort()
                raise


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
