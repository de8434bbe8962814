"""Retention: which generations a run keeps, as small composable rules.

:class:`Retention` is the user's policy: a plain, validated dataclass. It turns into
a tuple of rule objects (:class:`KeepLast`, :class:`KeepEvery`, :class:`KeepBest`,
:class:`KeepWithin`, :class:`KeepCalendar`), each a tiny dataclass with one method,
:meth:`RetentionRule.keeps`, in the manner of Orbax's ``PreservationPolicy``. Rules
compose by union: a generation is kept when any rule keeps it, and the plan says
which rule(s) did. Rules never delete anything; what is always kept regardless of
them (newest verified generation, a verified fallback, pins, leases, the restore
floor, what is in flight) and how deletion happens are decided by
:mod:`ckptvault.retention.plan`.

Calendar rules follow restic/borg: ``keep_hourly=H`` keeps, for each of the H most
recent hours that hold a generation, the newest generation of that hour; days and
ISO weeks likewise. Times are the creation times in generation ids (UTC).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Protocol

from ckptvault.errors import UsageError
from ckptvault.format.layout import GenerationName

DEFAULT_DELETE_DELAY = 86400.0  # one day between marking a generation and deleting it
# delete_delay's default: 0 for a policy of keep_last alone (space back at the next
# save, as save_total_limit and max_to_keep do), DEFAULT_DELETE_DELAY for any other.
AUTO_DELETE_DELAY = "auto"
MODES = ("min", "max")
_METRIC_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]{0,127}\Z")


@dataclass(frozen=True)
class RuleInput:
    """What a rule may look at: a generation's name, creation time and metrics."""

    name: GenerationName
    created: datetime  # UTC, from the generation id
    metrics: Mapping[str, float] | None = None  # None: not read or not recorded

    @property
    def step(self) -> int:
        return self.name.step


class RetentionRule(Protocol):
    """One way of choosing generations to keep."""

    def keeps(self, generations: Sequence[RuleInput], now: datetime) -> dict[GenerationName, str]:
        """The generations this rule keeps, each with a short reason naming the rule.
        ``generations`` is newest first (by step, then creation)."""


@dataclass(frozen=True)
class KeepLast:
    """The ``count`` newest generations."""

    count: int

    def keeps(self, generations: Sequence[RuleInput], now: datetime) -> dict[GenerationName, str]:
        return {g.name: f"keep_last={self.count}" for g in generations[: self.count]}


@dataclass(frozen=True)
class KeepEvery:
    """Every generation whose step is a multiple of ``steps`` (milestones, for ever)."""

    steps: int

    def keeps(self, generations: Sequence[RuleInput], now: datetime) -> dict[GenerationName, str]:
        return {g.name: f"keep_every={self.steps}" for g in generations if g.step % self.steps == 0}


@dataclass(frozen=True)
class KeepBest:
    """The ``count`` best generations by ``metric`` (``mode`` "min" or "max"), among
    those that recorded it; ties go to the newer generation."""

    count: int
    metric: str
    mode: str = "min"

    def keeps(self, generations: Sequence[RuleInput], now: datetime) -> dict[GenerationName, str]:
        scored = [
            (g.metrics[self.metric], position, g)
            for position, g in enumerate(generations)  # newest first: lower position wins ties
            if g.metrics is not None and self.metric in g.metrics
        ]
        sign = 1.0 if self.mode == "min" else -1.0
        scored.sort(key=lambda item: (sign * item[0], item[1]))
        return {
            g.name: f"keep_best={self.count} ({self.metric}={value:g}, {self.mode})"
            for value, _position, g in scored[: self.count]
        }


@dataclass(frozen=True)
class KeepWithin:
    """Every generation created less than ``seconds`` before now."""

    seconds: float

    def keeps(self, generations: Sequence[RuleInput], now: datetime) -> dict[GenerationName, str]:
        since = now - timedelta(seconds=self.seconds)
        label = f"keep_within={format_seconds(self.seconds)}"
        return {g.name: label for g in generations if g.created >= since}


def _hour(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H")


def _day(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%d")


def _iso_week(moment: datetime) -> str:
    year, week, _ = moment.isocalendar()
    return f"{year}-W{week:02d}"


_PERIODS = {"hourly": _hour, "daily": _day, "weekly": _iso_week}


@dataclass(frozen=True)
class KeepCalendar:
    """For each of the ``count`` most recent periods (``"hourly"``, ``"daily"``,
    ``"weekly"``: ISO weeks) that hold a generation, the newest generation of it."""

    period: str
    count: int

    def keeps(self, generations: Sequence[RuleInput], now: datetime) -> dict[GenerationName, str]:
        bucket_of = _PERIODS[self.period]
        kept: dict[GenerationName, str] = {}
        seen: set[str] = set()
        for g in sorted(generations, key=lambda g: (g.created, g.name), reverse=True):
            bucket = bucket_of(g.created)
            if bucket in seen:
                continue
            if len(seen) == self.count:
                break
            seen.add(bucket)
            kept[g.name] = f"keep_{self.period}={self.count} ({bucket})"
        return kept


def format_seconds(seconds: float) -> str:
    """``90s``, ``30m``, ``24h``, ``7d``: the largest unit that divides evenly."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def _count(value: object, what: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(
            f"Retention({what}=...) must be a whole number of 1 or more, got {value!r} "
            "(leave it out for no such rule)"
        )
    return value


# A thousand years: a longer window or delay is no policy, and past it the dates it
# implies leave datetime's range (an OverflowError deep in a plan, not a UsageError).
MAX_SECONDS = 1000 * 365 * 86400.0


def _seconds(value: object, what: str, allow_zero: bool) -> float | None:
    if value is None:
        return None
    if (
        not isinstance(value, (int, float))
        or isinstance(value, bool)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not allow_zero)
        or value > MAX_SECONDS
    ):
        least = "a number of seconds >= 0" if allow_zero else "a number of seconds > 0"
        raise UsageError(
            f"Retention({what}=...) must be {least} and at most a thousand years "
            f"({MAX_SECONDS:.0f}), got {value!r}"
        )
    return float(value)


def check_metric_name(name: object, what: str = "metric") -> str:
    if not isinstance(name, str) or not _METRIC_NAME_RE.match(name):
        raise UsageError(
            f"{what} must be a name of letters, digits and _ . : / - (at most 128, not starting "
            f"with a digit), got {name!r}"
        )
    return name


@dataclass(frozen=True)
class Retention:
    """Which generations to keep; everything else is marked, then deleted after
    ``delete_delay`` seconds.

    A generation is kept when any rule keeps it:

    - ``keep_last=N``: the N newest generations;
    - ``keep_every=STEPS``: every generation whose step is a multiple of STEPS;
    - ``keep_best=K`` with ``metric="val_loss"``, ``mode="min"`` (or ``"max"``): the K
      best generations among those saved with ``save(..., metrics={...})``;
    - ``keep_within=SECONDS``: everything created within SECONDS of now;
    - ``keep_hourly=H``, ``keep_daily=D``, ``keep_weekly=W``: the newest generation of
      each of the H (D, W) most recent hours (days, ISO weeks) that have one (UTC).

    Kept regardless: the newest generation that verified and an older one that
    verified (a fallback), pinned generations, the restore floor's generation,
    what is being written and what a reader holds a lease on.

    ``delete_delay`` (seconds; 0 deletes at once): a generation the rules drop is first
    marked — hidden from restore and ``ls``, but ``ckptvault gc --undelete STEP``
    brings it back — and its bytes go once the delay has passed. The default,
    ``"auto"``, is 0 for ``keep_last=N`` alone (space back at the next save, as
    Hugging Face's ``save_total_limit`` and Orbax's ``max_to_keep`` do) and one day
    for a policy with any other rule (a metric, a calendar or a time window chosen
    wrongly should cost a day's undelete, not the checkpoints). The safety net above
    holds with either delay; ``delete_delay`` holds the resolved number of seconds.
    """

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    metric: str | None = None
    mode: str = "min"
    keep_within: float | None = None
    keep_hourly: int | None = None
    keep_daily: int | None = None
    keep_weekly: int | None = None
    delete_delay: float = AUTO_DELETE_DELAY  # type: ignore[assignment]  # resolved below

    def __post_init__(self) -> None:
        counts = ("keep_last", "keep_every", "keep_best", "keep_hourly", "keep_daily")
        for name in (*counts, "keep_weekly"):
            _count(getattr(self, name), name)
        _seconds(self.keep_within, "keep_within", allow_zero=False)
        if isinstance(self.delete_delay, str) and self.delete_delay == AUTO_DELETE_DELAY:
            object.__setattr__(self, "delete_delay", self._default_delay())
        delay = _seconds(self.delete_delay, "delete_delay", allow_zero=True)
        if delay is None:
            raise UsageError(
                "Retention(delete_delay=...) must be a number of seconds >= 0 (or 'auto')"
            )
        object.__setattr__(self, "delete_delay", delay)
        if self.mode not in MODES:
            raise UsageError(f"Retention(mode=...) must be 'min' or 'max', got {self.mode!r}")
        if self.keep_best is not None:
            if self.metric is None:
                raise UsageError(
                    "Retention(keep_best=...) needs metric=NAME, a metric recorded with "
                    "save(step, state, metrics={NAME: value})"
                )
            check_metric_name(self.metric, "Retention(metric=...)")
        elif self.metric is not None:
            raise UsageError("Retention(metric=...) is used only with keep_best=K: give both")
        if not self.rules:
            raise UsageError(
                "Retention() with no keep_* rule would keep only the newest generation and its "
                "fallback; give at least one rule, e.g. Retention(keep_last=3)"
            )

    def _default_delay(self) -> float:
        others = ("keep_every", "keep_best", "keep_within", "keep_hourly", "keep_daily")
        only_last = all(getattr(self, name) is None for name in (*others, "keep_weekly"))
        return 0.0 if self.keep_last is not None and only_last else DEFAULT_DELETE_DELAY

    @property
    def rules(self) -> tuple[RetentionRule, ...]:
        """The rule objects, in a fixed order; a generation any of them keeps is kept."""
        rules: list[RetentionRule] = []
        if self.keep_last is not None:
            rules.append(KeepLast(self.keep_last))
        if self.keep_every is not None:
            rules.append(KeepEvery(self.keep_every))
        if self.keep_best is not None and self.metric is not None:
            rules.append(KeepBest(self.keep_best, self.metric, self.mode))
        if self.keep_within is not None:
            rules.append(KeepWithin(float(self.keep_within)))
        for period in ("hourly", "daily", "weekly"):
            count = getattr(self, f"keep_{period}")
            if count is not None:
                rules.append(KeepCalendar(period, count))
        return tuple(rules)

    def describe(self) -> str:
        """``keep_last=2, keep_every=1000, delete_delay=1d``: for plans and logs."""
        parts = []
        for name in (
            "keep_last",
            "keep_every",
            "keep_best",
            "keep_within",
            "keep_hourly",
            "keep_daily",
            "keep_weekly",
        ):
            value = getattr(self, name)
            if value is not None:
                shown = format_seconds(value) if name == "keep_within" else str(value)
                parts.append(f"{name}={shown}")
                if name == "keep_best":
                    parts.append(f"metric={self.metric}, mode={self.mode}")
        parts.append(f"delete_delay={format_seconds(self.delete_delay)}")
        return ", ".join(parts)
