"""The supervisor's hang watchdog: a job whose progress stops is a failed attempt.

``ckptvault supervise --hang-timeout S`` (or ``--hang-factor K``) gives each attempt
a fresh progress directory (:data:`~ckptvault.observe.heartbeat.PROGRESS_DIR_ENV`)
where every rank's manager records its heartbeats. :class:`HangWatch` reads it a
few times a second and says the job hangs when a rank that has reported stops
reporting for longer than the limit:

- ``timeout_s`` alone: that many seconds;
- ``factor`` K: K x the median interval between the reports seen so far in this
  supervise run (quantized by the writer's half-second cadence), never less than
  ``timeout_s`` (the floor; :data:`DEFAULT_FLOOR_S` when not given).

The job's own clock is never trusted: progress is when the supervisor sees a
rank's record change: a heartbeat, or a save that wrote more bytes (its record says
``phase: "saving"`` and counts ``saved_bytes``), so a save that writes for longer
than the limit is not a hang, and one whose storage stopped answering is (the
verdict says it stopped during a save). Only heartbeats make the intervals a factor
scales. Start-up is not watched: until the first report (imports,
a restore, compilation) nothing can be measured, so a job that hangs before its
first ``save()``/``heartbeat()`` is not caught. A record the watch cannot read is
ignored with one warning each.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ckptvault.errors import UsageError
from ckptvault.observe.heartbeat import WRITE_INTERVAL_S, ProgressRecord, scan_progress

DEFAULT_FLOOR_S = 120.0  # the least a factor-based limit waits (start-up aside)
MIN_TIMEOUT_S = 2 * WRITE_INTERVAL_S  # a report can lag the last heartbeat this much
READ_EVERY_S = 0.25  # how often the directory is read
INTERVALS_KEPT = 1000  # reports' intervals the median is taken over


@dataclass(frozen=True)
class HangPolicy:
    """When a job counts as hung (see the module docstring)."""

    timeout_s: float | None = None
    factor: float | None = None

    def __post_init__(self) -> None:
        if self.timeout_s is None and self.factor is None:
            raise UsageError("a hang watchdog needs --hang-timeout SECONDS or --hang-factor K")
        if self.timeout_s is not None and not (
            math.isfinite(self.timeout_s) and self.timeout_s >= MIN_TIMEOUT_S
        ):
            raise UsageError(
                f"--hang-timeout {self.timeout_s:g}: give at least {MIN_TIMEOUT_S:g} s "
                f"(progress is recorded at most every {WRITE_INTERVAL_S:g} s)"
            )
        if self.factor is not None and not (math.isfinite(self.factor) and self.factor >= 1):
            raise UsageError(f"--hang-factor {self.factor:g}: give a factor of at least 1")

    def limit(self, median_interval: float | None) -> float:
        """Seconds without progress that make a hang, given the median interval
        between reports so far (None: none measured yet)."""
        floor = self.timeout_s if self.timeout_s is not None else DEFAULT_FLOOR_S
        if self.factor is None or median_interval is None:
            return floor
        return max(floor, self.factor * median_interval)

    def describe(self) -> str:
        if self.factor is None:
            return f"{self.timeout_s:g} s without progress"
        floor = self.timeout_s if self.timeout_s is not None else DEFAULT_FLOOR_S
        return f"{self.factor:g} x the median interval between reports (at least {floor:g} s)"


@dataclass
class IntervalHistory:
    """Intervals between a rank's reports, over the whole supervise run (a restart
    does not change how often the job reports)."""

    intervals: deque[float] = field(default_factory=lambda: deque(maxlen=INTERVALS_KEPT))

    def median(self) -> float | None:
        return statistics.median(self.intervals) if self.intervals else None


@dataclass(frozen=True)
class _Seen:
    """What the watch last saw of one rank, and when (the supervisor's clock)."""

    record: ProgressRecord
    changed_at: float  # the record last changed: any progress
    beat_at: float  # its heartbeat counter last changed

    def progressed(self, record: ProgressRecord) -> bool:
        return _progress_of(record) != _progress_of(self.record)

    def new_beat(self, record: ProgressRecord) -> bool:
        return (record.pid, record.beats) != (self.record.pid, self.record.beats)


def _progress_of(record: ProgressRecord) -> tuple[int, int, str, int]:
    """What changes when a rank progresses: a heartbeat, a save's bytes, its phase
    (a restarted process is a new pid)."""
    return (record.pid, record.beats, record.phase, record.saved_bytes)


def _where(seen: _Seen, rank: int) -> str:
    """Where a stalled rank was, for the verdict."""
    record = seen.record
    where = f"rank {rank} last reported step {record.step}"
    if record.phase != "saving":
        return where
    return (
        f"{where}, during a save that stopped writing (the checkpoint storage, or a rank "
        "the save waits for, stopped answering)"
    )


class HangWatch:
    """Watches one attempt's progress directory; :meth:`check` returns why the job
    hangs, or None. ``clock``: monotonic seconds; ``warn``: told each distinct
    problem with a record once."""

    def __init__(
        self,
        directory: Path,
        policy: HangPolicy,
        history: IntervalHistory,
        warn: Callable[[str], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory, self.policy, self.history = directory, policy, history
        self._warn, self._clock = warn, clock
        self._seen: dict[int, _Seen] = {}
        self._read_at: float | None = None
        self._warned: set[str] = set()

    def check(self) -> str | None:
        now = self._clock()
        if self._read_at is None or now - self._read_at >= READ_EVERY_S:
            self._read_at = now
            self._read(now)
        if not self._seen:
            return None  # nothing reported yet: start-up is not watched
        rank, seen = min(self._seen.items(), key=lambda item: item[1].changed_at)
        idle, limit = now - seen.changed_at, self.policy.limit(self.history.median())
        if idle <= limit:
            return None
        return (
            f"no progress for {idle:.1f} s (limit {limit:g} s: {self.policy.describe()}); "
            f"{_where(seen, rank)}"
        )

    def _read(self, now: float) -> None:
        records, problems = scan_progress(self.directory)
        for problem in problems:
            if problem not in self._warned and len(self._warned) < 100:
                self._warned.add(problem)
                self._warn(f"hang watchdog: ignoring a progress record: {problem}")
        for record in records:
            seen = self._seen.get(record.rank)
            if seen is None:
                self._seen[record.rank] = _Seen(record, now, now)
            elif seen.progressed(record):
                beat_at = seen.beat_at
                if seen.new_beat(record):  # a save's bytes are not the job's cadence
                    self.history.intervals.append(now - seen.beat_at)
                    beat_at = now
                self._seen[record.rank] = _Seen(record, now, beat_at)
