"""The rank/world seam: who this process is among the processes of one job.

Everything that depends on the job's shape asks a :class:`Coordinator`: the writer
names tensor files after its rank, the manifest records the world size, restore
lets the coordinating rank choose the generation and tells the others. Today the
only implementation is :class:`SingleProcess`; the multi-rank path plugs
``torch.distributed`` in behind the same protocol.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

T = TypeVar("T")


@runtime_checkable
class Coordinator(Protocol):
    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_coordinator(self) -> bool:
        """True on the one rank that writes manifests and publishes."""

    def barrier(self) -> None:
        """Return once every rank has called it."""

    def broadcast(self, value: T) -> T:
        """The coordinator's ``value``, on every rank (JSON-able values only)."""


class SingleProcess:
    """One process is the whole job: rank 0 of 1, coordinating itself."""

    rank = 0
    world_size = 1
    is_coordinator = True

    def barrier(self) -> None:
        return None

    def broadcast(self, value: T) -> T:
        return value

    def __repr__(self) -> str:
        return "SingleProcess()"
