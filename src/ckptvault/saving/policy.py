"""Save policies: when a training loop should save, as small composable objects.

Instead of ``if step % 500 == 0`` in every loop, a manager is given a policy and the
loop asks ``mgr.should_save(step)``::

    cv.Every(steps=500)                       # every 500 steps (step % 500 == 0)
    cv.Every(seconds=1800)                    # every 30 minutes of wall time
    cv.Planned(mtbf_hours=50_000, nodes=64)   # Daly's interval, from measured save cost
    cv.Any(cv.Every(steps=500), cv.Every(seconds=1800))   # whichever comes first

A policy is plain, immutable configuration and may be shared between managers; the
mutable part (when the last save was, what saves cost) is the :class:`Schedule` a
manager makes from it with :meth:`SavePolicy.schedule`. Schedules are told the time
(``now``, monotonic seconds) rather than reading a clock, so that they are pure and
tested without sleeping; the manager's :class:`~ckptvault.saving.decisions.SaveDecider`
reads the clock and makes every rank of a job give the same answer.

Step rules (``Every(steps=...)``) depend on the step alone, so every rank computes
the same answer by itself. Time rules (``Every(seconds=...)``, ``Planned``) depend on
this process's clock and on what its saves cost, which differ between ranks: their
``uses_clock`` is true, and the decider lets rank 0 decide for the job.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from ckptvault.errors import UsageError
from ckptvault.planning.cadence import SECONDS_PER_HOUR, daly_interval

__all__ = ["Any", "Every", "Planned", "SavePolicy", "Schedule"]

logger = logging.getLogger("ckptvault")

# Until a save has been measured, Planned assumes one costs this many seconds. Daly's
# interval grows with the square root of the cost, so a low guess errs toward an early
# first save: it costs one save, and measures the real cost. A high guess would leave
# the run unprotected for longer, which a failure in that time makes expensive.
ASSUMED_SAVE_S = 1.0
# The cost Planned plans with: the median of the newest saves measured (the first
# save of a process, which allocates its buffers, or one slow outlier does not move it).
COST_WINDOW = 5
# The interval in use changes only when the new estimate differs by this fraction:
# save times jitter, and an interval rewritten (and logged) every save helps no one.
CHANGE_THRESHOLD = 0.10
_MIN_COST_S = 1e-3  # a save measured as taking no time at all (a coarse clock)


@runtime_checkable
class Schedule(Protocol):
    """The state of one policy in one manager: when a save is due."""

    def due(self, step: int, now: float) -> bool:
        """Whether a save is due at ``step`` at time ``now`` (monotonic seconds);
        asking again, with nothing saved in between, gives the same answer."""

    def saved(self, step: int, now: float, cost_s: float) -> None:
        """A save of ``step`` returned at ``now``, after blocking training ``cost_s``
        seconds (the whole save when synchronous, the stall when asynchronous)."""


@runtime_checkable
class SavePolicy(Protocol):
    """When to save: immutable configuration that makes a :class:`Schedule`."""

    @property
    def uses_clock(self) -> bool:
        """Whether its decisions depend on this process's clock or save times (and so
        must be agreed between the ranks of a job)."""

    def schedule(self, now: float, measured_costs: Sequence[float] = ()) -> Schedule:
        """A fresh schedule whose clock starts at ``now``; ``measured_costs``: seconds
        earlier saves of this run blocked training (newest first), e.g. from the
        catalog after a restart."""


def _whole_number(owner: str, name: str, value: object, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(
            f"{owner}: {name}={value!r} is not a whole number of at least 1; give e.g. {example}"
        )
    return value


def _seconds(owner: str, name: str, value: object, example: str) -> float:
    number = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an int past float's range: math.isfinite would raise too
            number = math.inf
    if not math.isfinite(number) or number <= 0:
        huge = isinstance(value, int) and number == math.inf  # its repr may raise too
        shown = f"{name}=(an integer past float's range)" if huge else f"{name}={value!r}"
        raise UsageError(f"{owner}: {shown} is not a finite number above zero; give e.g. {example}")
    return number


def _duration(seconds: float) -> str:
    """``90.5`` -> ``'90.5 s'``: a few significant digits, whatever the scale."""
    return f"{seconds:.4g} s"


class Every:
    """Save every ``steps`` training steps (when ``step % steps == 0``: the same steps
    after a resume, on every rank) or every ``seconds`` of wall time since the last
    save began (the clock starts with the manager). Give exactly one; combine both
    with :class:`Any`."""

    __slots__ = ("seconds", "steps")

    def __init__(self, *args: object, steps: int | None = None, seconds: float | None = None):
        if args:
            raise UsageError(
                f"cv.Every({', '.join(map(repr, args))}): say what the number counts: cv.Every(steps=500) or "
                "cv.Every(seconds=1800)"
            )
        if (steps is None) == (seconds is None):
            raise UsageError(
                "cv.Every takes one of steps= or seconds=, e.g. cv.Every(steps=500); for "
                "both, combine two: cv.Any(cv.Every(steps=500), cv.Every(seconds=1800))"
            )
        self.steps = (
            None
            if steps is None
            else _whole_number("cv.Every", "steps", steps, "cv.Every(steps=500)")
        )
        self.seconds = (
            None
            if seconds is None
            else _seconds("cv.Every", "seconds", seconds, "cv.Every(seconds=1800)")
        )

    @property
    def uses_clock(self) -> bool:
        return self.seconds is not None

    def schedule(self, now: float, measured_costs: Sequence[float] = ()) -> Schedule:
        if self.steps is not None:
            return _EverySteps(self.steps)
        assert self.seconds is not None
        return _EverySeconds(self.seconds, now)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Every) and (self.steps, self.seconds) == (
            other.steps,
            other.seconds,
        )

    def __hash__(self) -> int:
        return hash((Every, self.steps, self.seconds))

    def __repr__(self) -> str:
        if self.steps is not None:
            return f"Every(steps={self.steps})"
        return f"Every(seconds={self.seconds:g})"


class Planned:
    """Save at Daly's optimal interval (:func:`ckptvault.planning.cadence.daly_interval`)
    for the save cost measured in this run and the stated failure rate.

    ``mtbf_hours``: the mean time between failures of one node; ``nodes``: the nodes
    the job runs on. Any node failing stops the job, so the job's MTBF is
    ``mtbf_hours / nodes``. The save cost is what a save blocked training (the whole
    save when synchronous, the stall when asynchronous): the median of the newest
    saves of this run, those before a restart included when the catalog has them.
    The interval counts from the end of the last save (Daly's ``tau``: work between
    saves), and is evaluated again after every save; each change is logged (logger
    ``ckptvault``, INFO) with the old and new interval and why.

    Before any save is measured, a save is assumed to cost 1 s
    (:data:`ASSUMED_SAVE_S`). Daly's interval grows with the square root of the cost,
    so the guess errs toward saving early: the first save then costs at most one
    save more than needed, and it measures the real cost; a high guess would leave
    the start of the run unprotected for longer.
    """

    __slots__ = ("mtbf_hours", "nodes")

    def __init__(self, mtbf_hours: float, nodes: int = 1) -> None:
        example = "cv.Planned(mtbf_hours=50_000, nodes=64)"
        self.mtbf_hours = _seconds("cv.Planned", "mtbf_hours", mtbf_hours, example)
        self.nodes = _whole_number("cv.Planned", "nodes", nodes, example)
        # Checked here, where every rank makes the policy: the schedule that would
        # fail on it is made on rank 0 alone, and one rank failing must not leave the
        # others waiting for it.
        job_mtbf_s = self.job_mtbf_s
        if not (math.isfinite(job_mtbf_s) and job_mtbf_s > 0):
            raise UsageError(
                f"cv.Planned(mtbf_hours={self.mtbf_hours:g}, nodes={self.nodes}): the job's MTBF "
                f"(mtbf_hours x 3600 / nodes) is {job_mtbf_s!r} seconds, not a usable number; "
                f"give a node's MTBF in hours, e.g. {example}"
            )

    @property
    def job_mtbf_s(self) -> float:
        """The job's MTBF in seconds: one node's, shared by ``nodes`` nodes."""
        return self.mtbf_hours * SECONDS_PER_HOUR / self.nodes

    uses_clock = True

    def schedule(self, now: float, measured_costs: Sequence[float] = ()) -> Schedule:
        return _PlannedSchedule(self, now, measured_costs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Planned) and (self.mtbf_hours, self.nodes) == (
            other.mtbf_hours,
            other.nodes,
        )

    def __hash__(self) -> int:
        return hash((Planned, self.mtbf_hours, self.nodes))

    def __repr__(self) -> str:
        return f"Planned(mtbf_hours={self.mtbf_hours:g}, nodes={self.nodes})"


class Any:
    """Save when any of ``policies`` says so (``cv.Any(cv.Every(steps=500),
    cv.Every(seconds=1800))``). Every one of them hears of every save: a save the
    step rule asked for also restarts the time rule's clock."""

    __slots__ = ("policies",)

    def __init__(self, *policies: SavePolicy) -> None:
        if not policies:
            raise UsageError(
                "cv.Any() needs at least one policy, e.g. "
                "cv.Any(cv.Every(steps=500), cv.Every(seconds=1800))"
            )
        for index, policy in enumerate(policies):
            check_policy(policy, f"cv.Any(...)'s policy {index + 1}")
        self.policies: tuple[SavePolicy, ...] = tuple(policies)

    @property
    def uses_clock(self) -> bool:
        return any(policy.uses_clock for policy in self.policies)

    def schedule(self, now: float, measured_costs: Sequence[float] = ()) -> Schedule:
        return _AnySchedule([p.schedule(now, measured_costs) for p in self.policies])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Any) and self.policies == other.policies

    def __hash__(self) -> int:
        return hash((Any, self.policies))

    def __repr__(self) -> str:
        return f"Any({', '.join(repr(p) for p in self.policies)})"


def check_policy(policy: object, where: str) -> SavePolicy:
    """``policy`` if it is a save policy; else a :class:`UsageError` naming ``where``."""
    if isinstance(policy, type) or not isinstance(policy, SavePolicy):
        raise UsageError(
            f"{where} is {policy!r}, not a save policy: give cv.Every(steps=N), "
            "cv.Every(seconds=S), cv.Planned(mtbf_hours=H, nodes=N) or cv.Any(...) of them"
        )
    return policy


# -- schedules ----------------------------------------------------------------------


class _EverySteps:
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def due(self, step: int, now: float) -> bool:
        return step % self.steps == 0

    def saved(self, step: int, now: float, cost_s: float) -> None:
        return None


class _EverySeconds:
    def __init__(self, seconds: float, now: float) -> None:
        self.seconds = seconds
        self.last_start = now  # when the last save began (the clock's start at first)

    def due(self, step: int, now: float) -> bool:
        return now - self.last_start >= self.seconds

    def saved(self, step: int, now: float, cost_s: float) -> None:
        self.last_start = now - max(0.0, cost_s)


class _AnySchedule:
    def __init__(self, schedules: list[Schedule]) -> None:
        self.schedules = schedules

    def due(self, step: int, now: float) -> bool:
        return any([s.due(step, now) for s in self.schedules])  # each asked: no shortcut

    def saved(self, step: int, now: float, cost_s: float) -> None:
        for schedule in self.schedules:
            schedule.saved(step, now, cost_s)


class _PlannedSchedule:
    """Daly's interval for the median measured cost; see :class:`Planned`."""

    def __init__(self, policy: Planned, now: float, measured: Sequence[float]) -> None:
        self.policy = policy
        self.last_end = now  # the end of the last save (the clock's start at first)
        self.costs: deque[float] = deque(maxlen=COST_WINDOW)
        for cost in reversed(list(measured)[:COST_WINDOW]):  # oldest first
            if math.isfinite(cost) and cost > 0:
                self.costs.append(max(cost, _MIN_COST_S))
        self.interval_s = daly_interval(self._cost(), policy.job_mtbf_s)
        logger.info(
            "save policy %r: checkpoint interval %s: %s (job MTBF %.4g h, Daly's interval)",
            policy,
            _duration(self.interval_s),
            self._why(earlier=True),
            policy.job_mtbf_s / SECONDS_PER_HOUR,
        )

    def _cost(self) -> float:
        return statistics.median(self.costs) if self.costs else ASSUMED_SAVE_S

    def _why(self, earlier: bool = False) -> str:
        if not self.costs:
            return f"no save measured yet, so a save is assumed to cost {_duration(ASSUMED_SAVE_S)}"
        source = "saves of this run before this process" if earlier else "saves"
        return (
            f"a save costs {_duration(self._cost())} "
            f"(median of the newest {len(self.costs)} {source})"
        )

    def due(self, step: int, now: float) -> bool:
        return now - self.last_end >= self.interval_s

    def saved(self, step: int, now: float, cost_s: float) -> None:
        self.last_end = now
        if math.isfinite(cost_s) and cost_s >= 0:
            self.costs.append(max(cost_s, _MIN_COST_S))
        interval = daly_interval(self._cost(), self.policy.job_mtbf_s)
        if abs(interval - self.interval_s) < CHANGE_THRESHOLD * self.interval_s:
            return
        logger.info(
            "save policy %r: checkpoint interval %s -> %s: %s (measured after step %d), "
            "job MTBF %.4g h",
            self.policy,
            _duration(self.interval_s),
            _duration(interval),
            self._why(),
            step,
            self.policy.job_mtbf_s / SECONDS_PER_HOUR,
        )
        self.interval_s = interval
