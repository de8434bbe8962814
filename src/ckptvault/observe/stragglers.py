"""Per-rank step times and stragglers: a rank whose recent step takes longer than
``factor`` times the median of the job's ranks.

:class:`StepClock` measures one rank's time per step from its heartbeats: the wall
time between two heartbeats, divided by the steps between them, less the time the
heartbeat itself spent waiting for the other ranks (so a fast rank that waits for a
slow one in the exchange is not counted slow). The rank's *recent step time* is the
median of the last :data:`WINDOW` samples: one slow step (a save, a compile) does
not make a straggler.

Wall time is what a rank can measure without help. In a job whose ranks meet in a
collective every step (data parallel's gradient all-reduce), the fast ranks wait
for the slow one inside that collective, so every rank's wall time per step is the
same: the job is slow, and no rank stands out. There, pass a rank's own compute time
(``mgr.heartbeat(step, step_seconds=...)``, e.g. CUDA-event time up to the
all-reduce) to find which rank it is.

:func:`exchange_step_times` gathers each rank's recent step time on the
coordinator as tiny JSON over the coordinator's gloo group (no pickle); the
coordinator checks each message, finds the stragglers (:func:`find_stragglers`)
and hands them to its metrics (:class:`RankTimesCollector`). Only the coordinator
keeps metrics, and nothing is decided from a peer's numbers, so a refused message
is logged on the coordinator and the ranks carry on.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptvault.coordinator import Coordinator
from ckptvault.errors import PeerMessageError, UsageError

logger = logging.getLogger("ckptvault")

WINDOW = 16  # samples of the recent step time (their median)
STRAGGLER_FACTOR = 1.5  # k: slower than k x the ranks' median is a straggler
MAX_STEP_SECONDS = 7 * 24 * 3600.0  # a step time a peer may report


class StepClock:
    """One rank's recent time per step, from its heartbeats (``clock``: monotonic
    seconds, read by the caller)."""

    def __init__(self, window: int = WINDOW) -> None:
        self._samples: deque[float] = deque(maxlen=window)
        self._last: tuple[int, float] | None = None  # (step, when) of the last advance
        self._waited = 0.0  # time spent in exchanges since then
        self._given = False  # the rank gives its own step times: wall time is not used

    def beat(self, step: int, now: float, step_seconds: float | None = None) -> None:
        """A heartbeat at ``step``. ``step_seconds``: the rank's own measure of its
        last step; once given, the wall time between heartbeats is no longer used."""
        if step_seconds is not None:
            self._samples.append(_checked_seconds(step_seconds))
            self._given = True
        last = self._last
        if last is None or step < last[0]:  # the first beat, or a restore went back
            self._last, self._waited = (step, now), 0.0
            return
        if step == last[0]:
            return  # should_save and save of the same step: one step, measured once
        if not self._given:
            busy = max(0.0, now - last[1] - self._waited)
            self._samples.append(busy / (step - last[0]))
        self._last, self._waited = (step, now), 0.0

    def waited(self, seconds: float) -> None:
        """Time spent waiting for the other ranks (an exchange): not this rank's step."""
        self._waited += max(0.0, seconds)

    def recent(self) -> float | None:
        """The median of the recent samples; None before the first."""
        return statistics.median(self._samples) if self._samples else None


def _checked_seconds(value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UsageError(f"step_seconds={value!r}: give the step's duration in seconds")
    # The range first: comparing an int to a float is exact, math.isfinite(10**400) raises.
    if not (0 <= value <= MAX_STEP_SECONDS and math.isfinite(value)):
        raise UsageError(f"step_seconds={value!r}: give a finite number of seconds >= 0")
    return float(value)


def find_stragglers(times: Mapping[int, float], factor: float = STRAGGLER_FACTOR) -> set[int]:
    """The ranks whose time exceeds ``factor`` x the median of all ranks' times."""
    if not times:
        return set()
    limit = factor * statistics.median(times.values())
    return {rank for rank, seconds in times.items() if seconds > limit}


def exchange_step_times(coordinator: Coordinator, recent: float | None) -> dict[int, float] | None:
    """Every rank's recent step time, on the coordinator (ranks that have none yet
    are left out); None on the other ranks, and on the coordinator when a peer's
    message was refused (logged). A collective: every rank calls it together."""
    try:
        gathered = coordinator.gather({"step_s": recent})
    except PeerMessageError as exc:  # on rank 0 only; the others carry on alike
        logger.warning("ckptvault: step times not updated: %s", exc)
        return None
    if gathered is None:
        return None
    times = {}
    for rank, message in enumerate(gathered):
        try:
            seconds = _peer_seconds(message, rank)
        except PeerMessageError as exc:
            logger.warning("ckptvault: step times not updated: %s", exc)
            return None
        if seconds is not None:
            times[rank] = seconds
    return times


def _peer_seconds(message: Any, rank: int) -> float | None:
    if not isinstance(message, dict) or set(message) != {"step_s"}:
        raise PeerMessageError(f"rank {rank} sent {str(message)[:100]!r}, not its step time")
    value = message["step_s"]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PeerMessageError(f"rank {rank} sent a step time {value!r} that is not a number")
    # The range first: a peer's 10**400 is valid JSON, and math.isfinite would raise on it.
    if not (0 <= value <= MAX_STEP_SECONDS and math.isfinite(value)):
        raise PeerMessageError(f"rank {rank} sent a step time {value!r} out of range")
    return float(value)


@dataclass
class RankTimes:
    """The latest exchange's step times and stragglers (thread-safe: the training
    thread updates, a scrape reads)."""

    factor: float = STRAGGLER_FACTOR
    _times: dict[int, float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def update(self, times: Mapping[int, float]) -> None:
        """Replace the step times (the stragglers are found when read)."""
        with self._lock:
            self._times = dict(times)

    def snapshot(self) -> tuple[dict[int, float], set[int]]:
        with self._lock:
            times = dict(self._times)
        return times, find_stragglers(times, self.factor)


class RankTimesCollector:
    """Prometheus collector of :class:`RankTimes`: ``ckptvault_rank_step_seconds``
    and ``ckptvault_straggler`` (1 for a straggler, 0 otherwise), by ``run_id`` and
    ``rank``. Register it in the manager's registry (the coordinator's)."""

    def __init__(self, run_id: str, times: RankTimes) -> None:
        import importlib

        self.core = importlib.import_module("prometheus_client.core")
        self.run_id, self.times = run_id, times

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        times, stragglers = self.times.snapshot()
        if not times:
            return
        step = self.core.GaugeMetricFamily(
            "ckptvault_rank_step_seconds",
            "Each rank's recent time per step (median of its last steps).",
            labels=["run_id", "rank"],
        )
        slow = self.core.GaugeMetricFamily(
            "ckptvault_straggler",
            f"1 when the rank's recent step time exceeds {self.times.factor:g} x the "
            "median of the ranks', else 0.",
            labels=["run_id", "rank"],
        )
        for rank in sorted(times):
            step.add_metric([self.run_id, str(rank)], times[rank])
            slow.add_metric([self.run_id, str(rank)], 1.0 if rank in stragglers else 0.0)
        yield step
        yield slow
