"""``should_save(step)``: one answer for the whole job.

A job's ranks must agree on every save: a save is collective, and a rank that saves
while another trains on waits for it until the collective times out. Step rules give
the same answer everywhere by themselves. Time rules do not: each rank has its own
clock, its own step times and its own measured save cost. So when the policy uses
the clock (:attr:`~ckptvault.saving.policy.SavePolicy.uses_clock`) and the job has
several ranks, rank 0 alone keeps the schedule and decides, and broadcasts its
answer through the coordinator: one tiny collective per question, a JSON ``true`` or
``false``, checked on arrival like any other message between ranks (never pickled).
A job of step rules alone, or of one process, runs no collective at all.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from ckptvault.coordinator import Coordinator
from ckptvault.errors import PeerMessageError
from ckptvault.saving.policy import SavePolicy, Schedule, check_policy

__all__ = ["SaveDecider"]


class SaveDecider:
    """A policy's schedule in one manager, and the agreement between ranks.

    ``measured_costs``: seconds earlier saves of this run blocked training, newest
    first (rank 0's catalog after a restart); ``clock``: monotonic seconds."""

    def __init__(
        self,
        policy: SavePolicy,
        coordinator: Coordinator,
        measured_costs: Sequence[float] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = check_policy(policy, "save_policy=")
        self.coordinator = coordinator
        self._clock = clock
        self._agreed = policy.uses_clock and coordinator.world_size > 1
        # With agreement, only rank 0's schedule decides: the others keep none (a
        # Planned schedule of theirs would only log intervals nobody uses).
        keeps = not self._agreed or coordinator.is_coordinator
        self._schedule: Schedule | None = (
            policy.schedule(clock(), measured_costs) if keeps else None
        )

    def should_save(self, step: int) -> bool:
        """Whether ``step`` is to be saved; the same answer on every rank. Every rank
        must ask, for the same steps, when the policy uses the clock."""
        if not self._agreed:
            assert self._schedule is not None
            return self._schedule.due(step, self._clock())
        mine = self._schedule.due(step, self._clock()) if self._schedule is not None else None
        answer = self.coordinator.broadcast(mine)
        if type(answer) is not bool:  # the same bytes on every rank: all raise alike
            raise PeerMessageError(
                f"rank 0 answered whether to save step {step} with {str(answer)[:40]!r}, "
                "not true or false; refused on every rank: check rank 0's host and software"
            )
        return answer

    def saved(self, step: int, cost_s: float) -> None:
        """A save of ``step`` returned, having blocked training ``cost_s`` seconds."""
        if self._schedule is not None:
            self._schedule.saved(step, self._clock(), cost_s)
