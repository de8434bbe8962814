"""The global save plan, kept across saves of an unchanged structure.

DCP's planner makes the global plan on rank 0 from every rank's local plan (dedup of
replicas, the global metadata, its checks), and rank 0 then validates every rank's
write results and works out what each rank's index holds: at 1,024 ranks of a
723-tensor model that is about a minute of rank 0's time, on every save, for an
answer that changes only when the state's structure does. So, as DCP's own plan
caching does (``DefaultSavePlanner(enable_plan_caching=True)``), ckptvault keeps it:

- every rank keeps the digest of its local plan (:func:`plan_digest`: the BLAKE3 of
  the plan's JSON, computed from the plan DCP's planner just made on every save,
  never remembered from an earlier one) and the assignment rank 0 sent for it;
- rank 0 keeps the world size, every rank's plan digest (each computed by rank 0
  from the plan that rank sent), the tensor table the root lists, DCP's metadata
  version and, per rank, what its index must hold besides digests
  (:class:`~ckptvault.distributed.rank_index.IndexExpectation`).

A save starts with each rank's digest, and whether it holds an assignment for it,
gathered on rank 0. Rank 0 reuses the plan only when the world size is the same,
every digest equals the one it holds for that rank and every rank holds its
assignment; otherwise every rank sends its plan in full and the plan is made
afresh. A shape, a dtype, a tensor added or removed, a rank's shards: all are in
its plan's digest, so any change replans.

What a save planned becomes current only when the whole save succeeded
(:meth:`SavePlanCache.commit`, on every rank once every rank learned the outcome);
a failed save forgets everything on every rank (:meth:`SavePlanCache.forget`), so
the next one plans afresh.

A rank that announced an unchanged digest though its plan changed (the digest is
computed from the plan, so only a bug or modified code does that) cannot make
rank 0 publish a root that disagrees with the files: on every save, reused plan or
not, rank 0 checks each rank's files (names and sizes) and index
(:mod:`~ckptvault.distributed.rank_index`) against what it validated when it made
the plan. Such a rank can still write other bytes than its state holds, as any
dishonest rank can; every byte still has to match its digest at restore.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from blake3 import blake3

from ckptvault.distributed.rank_index import IndexExpectation
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.tensor_table import TensorTable


def plan_digest(message: dict[str, Any]) -> str:
    """The BLAKE3 of a local plan message's canonical JSON
    (:func:`~ckptvault.distributed.plan_wire.plan_to_json`); the same on the rank that
    made it and on rank 0, which computes it again from what it received."""
    return blake3(dumps_canonical(message)).hexdigest()


@dataclass(frozen=True)
class RankPlan:
    """A rank's own part: its plan's digest and rank 0's assignment for it."""

    digest: str
    assignment: dict[str, Any]


@dataclass(frozen=True)
class CentralPlan:
    """Rank 0's part: what it made and validated from every rank's plan."""

    world: int
    digests: tuple[str, ...]  # by rank
    table: TensorTable
    dcp_version: str | None
    expectations: dict[int, IndexExpectation]  # by rank, for every rank that writes a file


class SavePlanCache:
    """One writer's plans (see the module docstring). Not thread-safe: a writer
    saves one generation at a time."""

    def __init__(self) -> None:
        self.rank: RankPlan | None = None
        self.central: CentralPlan | None = None
        self._staged_rank: RankPlan | None = None
        self._staged_central: CentralPlan | None = None

    def holds(self, digest: str) -> bool:
        """Whether this rank holds an assignment for a local plan of ``digest``."""
        return self.rank is not None and self.rank.digest == digest

    def reusable(self, world: int, digests: list[str], held: list[bool]) -> CentralPlan | None:
        """Rank 0: the kept plan, when every rank's plan is unchanged and every rank
        holds its assignment; None otherwise."""
        central = self.central
        if central is None or central.world != world or not all(held):
            return None
        return central if tuple(digests) == central.digests else None

    def stage_rank(self, plan: RankPlan) -> None:
        self._staged_rank = plan

    def stage_central(self, plan: CentralPlan) -> None:
        self._staged_central = plan

    def commit(self) -> None:
        """The save succeeded on every rank: what it planned is the plan now."""
        if self._staged_rank is not None:
            self.rank, self._staged_rank = self._staged_rank, None
        if self._staged_central is not None:
            self.central, self._staged_central = self._staged_central, None

    def forget(self) -> None:
        """The save failed (or the writer closes): the next save plans afresh."""
        self.rank = self.central = self._staged_rank = self._staged_central = None
