"""What a manager does at each heartbeat: measure the step time, record progress
for a watchdog, and now and then gather every rank's step time for the metrics.

``CheckpointManager.heartbeat(step)``, ``save()`` and ``should_save()`` each call
:meth:`ProgressReporter.beat`. A beat costs a clock read and, at most twice a
second, the write of a tiny file (:mod:`ckptvault.observe.heartbeat`). Step times
are exchanged between ranks (:mod:`ckptvault.observe.stragglers`) at every save and
every :data:`EXCHANGE_EVERY`-th beat otherwise: a collective, so every rank must
beat alike (as it saves alike); the exchange's own wait is not counted as step time.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ckptvault.coordinator import Coordinator
from ckptvault.observe.heartbeat import ProgressRecord, ProgressWriter, progress_directory
from ckptvault.observe.stragglers import (
    RankTimes,
    RankTimesCollector,
    StepClock,
    exchange_step_times,
)

EXCHANGE_EVERY = 100  # beats between two exchanges of step times (saves always exchange)


class ProgressReporter:
    """One manager's heartbeats (see the module docstring)."""

    def __init__(
        self,
        run_id: str,
        coordinator: Coordinator,
        directory: Path,
        registry: Any = None,
        exchange_every: int = EXCHANGE_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_id, self.coordinator = run_id, coordinator
        self.writer = ProgressWriter(directory, coordinator.rank, clock=clock)
        self.clock = StepClock()
        self.rank_times = RankTimes()
        self.exchange_every, self._now = exchange_every, clock
        self.beats = 0
        self._step = 0
        if registry is not None:
            registry.register(RankTimesCollector(run_id, self.rank_times))

    @classmethod
    def for_manager(
        cls,
        run_id: str,
        coordinator: Coordinator,
        ledger: str | os.PathLike[str] | None,
        registry: Any,
    ) -> ProgressReporter:
        """The reporter of a manager: the supervisor's progress directory, or the
        default beside the ledger; step-time metrics in ``registry`` (None: none)."""
        return cls(run_id, coordinator, progress_directory(run_id, ledger), registry)

    def beat(self, step: int, *, exchange: bool = False, step_seconds: float | None = None) -> None:
        """Record progress at ``step``; ``exchange``: gather step times now (a save)."""
        self.clock.beat(step, self._now(), step_seconds)
        self.beats += 1
        self._step = step
        if exchange or self.beats % self.exchange_every == 0:
            self._exchange()
        self.writer.offer(self._record)

    def _exchange(self) -> None:
        started = self._now()
        times = exchange_step_times(self.coordinator, self.clock.recent())
        self.clock.waited(self._now() - started)
        if times is not None:
            self.rank_times.update(times)

    def _record(self) -> ProgressRecord:
        return ProgressRecord(
            run_id=self.run_id[:256],
            rank=self.coordinator.rank,
            world_size=self.coordinator.world_size,
            pid=os.getpid(),
            step=self._step,
            beats=self.beats,
            at=time.time(),
            step_seconds=self.clock.recent(),
        )
