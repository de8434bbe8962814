"""What a manager does at each heartbeat: measure the step time, record progress
for a watchdog, and now and then gather every rank's step time for the metrics.

``CheckpointManager.heartbeat(step)``, ``save()`` and ``should_save()`` each call
:meth:`ProgressReporter.beat`. A beat costs a clock read and, at most twice a
second, the write of a tiny file (:mod:`ckptvault.observe.heartbeat`).

Step times are exchanged between ranks (:mod:`ckptvault.observe.stragglers`) at the
10th, 25th and 50th ``heartbeat()``/``should_save()`` call and every
:data:`EXCHANGE_EVERY`-th after that (early ones fill the metrics soon after a
start): a collective, so every rank must make these calls alike, as it saves alike.
``save()`` records progress but never exchanges: a save's collectives stay its own.
The exchange's own wait is not counted as step time. One process alone needs no
exchange: its step time goes to the metrics at every beat.

The reporter also watches this manager's saves (a
:class:`~ckptvault.saving.save_watch.SaveWatcher`). While one runs, the record's
``phase`` is ``"saving"`` and ``saved_bytes`` grows with each piece written, offered
to the same throttled writer (from the writer threads: a lock, a counter and a clock
read per piece of about a MiB). A save that writes is progress to a watchdog; one
whose storage stopped answering is not. Two records are written whatever the
throttle says: when a save starts (a store that is down blocks a save at its first
I/O, and the watchdog should say the save hung, not the step), and when the last one
ends, if the file still says ``"saving"`` (a hang after a save is never blamed on
it).
"""

from __future__ import annotations

import os
import threading
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

EXCHANGE_EVERY = 100  # heartbeat()/should_save() calls between two exchanges
EARLY_EXCHANGES = (10, 25, 50)  # and these calls, so that a new run shows figures soon


def exchanges_at(calls: int) -> bool:
    """Whether the ``calls``-th heartbeat()/should_save() call exchanges step times
    (the same answer on every rank: it depends on the count alone)."""
    return calls in EARLY_EXCHANGES or calls % EXCHANGE_EVERY == 0


class ProgressReporter:
    """One manager's heartbeats (see the module docstring)."""

    def __init__(
        self,
        run_id: str,
        coordinator: Coordinator,
        directory: Path,
        registry: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.run_id, self.coordinator = run_id, coordinator
        self.writer = ProgressWriter(directory, coordinator.rank, clock=clock)
        self.clock = StepClock()
        self.rank_times = RankTimes()
        self._now = clock
        self.beats = 0  # every beat (the progress file's counter)
        self.calls = 0  # beats that may exchange (heartbeat, should_save)
        self._step = 0
        self.saved_bytes = 0  # written by this process's saves
        self._saving = 0  # saves writing now
        # Records are built on the writer threads too: what they read changes under it.
        self._lock = threading.Lock()
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

    def beat(
        self, step: int, *, collective: bool = True, step_seconds: float | None = None
    ) -> None:
        """Record progress at ``step``. ``collective``: this call may run the step-time
        exchange (heartbeat, should_save); False for a save."""
        with self._lock:
            self.clock.beat(step, self._now(), step_seconds)
            self.beats += 1
            self._step = step
        if self.coordinator.world_size == 1:
            recent = self.clock.recent()
            if recent is not None:
                self.rank_times.update({0: recent})
        elif collective:
            self.calls += 1
            if exchanges_at(self.calls):
                self._exchange()
        self.writer.offer(self._record)

    def _exchange(self) -> None:
        started = self._now()
        times = exchange_step_times(self.coordinator, self.clock.recent())
        with self._lock:
            self.clock.waited(self._now() - started)
        if times is not None:
            self.rank_times.update(times)

    # -- a save's progress (SaveWatcher): from any thread --------------------------------

    def save_started(self) -> None:
        with self._lock:
            self._saving += 1
            first = self._saving == 1
        if first:
            self.writer.offer(self._record, force=True)

    def wrote(self, nbytes: int) -> None:
        with self._lock:
            self.saved_bytes += nbytes
        self.writer.offer(self._record)

    def save_ended(self) -> None:
        with self._lock:
            self._saving -= 1
            ended = self._saving == 0
        last = self.writer.last
        if ended and last is not None and last.phase == "saving":
            self.writer.offer(self._record, force=True)

    def _record(self) -> ProgressRecord:
        with self._lock:
            return ProgressRecord(
                run_id=self.run_id[:256],
                rank=self.coordinator.rank,
                world_size=self.coordinator.world_size,
                pid=os.getpid(),
                step=self._step,
                beats=self.beats,
                at=time.time(),
                step_seconds=self.clock.recent(),
                phase="saving" if self._saving else "training",
                saved_bytes=self.saved_bytes,
            )
