"""The rank/world seam: who this process is among the processes of one job.

Everything that depends on the job's shape asks a :class:`Coordinator`: the writer
names tensor files after its rank, the manifest records the world size, restore
lets the coordinating rank choose the generation and tells the others, and every
rank's verdict is combined before anything is published or applied.
:class:`SingleProcess` is one process alone;
:class:`~ckptvault.distributed.coordinator.TorchDistributed` is a torch.distributed
job, chosen by the manager when a process group of more than one rank exists.
"""

from __future__ import annotations

from typing import Any, Protocol, TypeVar, runtime_checkable

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

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (JSON-able), in rank order, on every rank."""

    def gather(self, value: Any) -> list[Any] | None:
        """Every rank's ``value`` (JSON-able), in rank order, on the coordinator;
        None on the other ranks. When a message is refused only the coordinator
        raises (``PeerMessageError``): its caller must still take part in what the
        others do next, and tell them."""

    def scatter(self, values: list[Any] | None) -> Any:
        """The coordinator's ``values[rank]`` (JSON-able) on each rank; the other
        ranks pass None. A refused message raises on the rank that received it."""

    @property
    def process_group(self) -> Any:
        """The torch.distributed group ckptvault's own collectives run on; None for
        one process. No DCP collective runs on it: DCP's are pickled."""


class SingleProcess:
    """One process is the whole job: rank 0 of 1, coordinating itself."""

    rank = 0
    world_size = 1
    is_coordinator = True

    def barrier(self) -> None:
        return None

    def broadcast(self, value: T) -> T:
        return value

    def all_gather(self, value: Any) -> list[Any]:
        return [value]

    def gather(self, value: Any) -> list[Any] | None:
        return [value]

    def scatter(self, values: list[Any] | None) -> Any:
        assert values is not None and len(values) == 1
        return values[0]

    process_group = None

    def __repr__(self) -> str:
        return "SingleProcess()"
