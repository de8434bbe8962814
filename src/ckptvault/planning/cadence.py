"""How often to checkpoint: Young's and Daly's intervals and what an interval costs.

Pure functions, no I/O; ``ckptvault plan`` (:mod:`ckptvault.cli.plan`) wires them to
the command line, :mod:`ckptvault.planning.sizing` sizes checkpoints and storage.

Symbols, all in seconds: ``C`` the cost of one save (for asynchronous saves the
stall, the time ``save()`` blocks training), ``M`` the job's mean time between
failures, ``R`` the time from a failure to training again (restart and restore),
``tau`` the compute time between the end of one save and the start of the next.

The model (Daly 2006): failures arrive as a Poisson process of mean
interval ``M``; each segment is ``tau`` of work followed by a save of ``C``; a
failure anywhere in a segment, the save included, costs the restart ``R`` and the
whole segment is done again. The expected wall-clock time per second of useful
work is then ``M * e^(R/M) * (e^((tau+C)/M) - 1) / tau``, and the *overhead
fraction* is that minus one: extra wall-clock per second of useful work (so 0.05
means a run takes 5 % longer than without saves and failures; it can exceed 1).
Its first-order expansion for ``C, tau << M`` is the textbook model

    overhead(tau) ~ C/tau + (tau/2 + R)/M      (+ C/(2M), constant in tau)

whose minimum is Young's interval ``sqrt(2CM)`` (J. W. Young, "A first order
approximation to the optimum checkpoint interval", Comm. ACM 17(9), 1974). Daly's
higher-order estimate of the full model's minimum (J. T. Daly, "A higher order
estimate of the optimum checkpoint interval for restart dumps", Future Generation
Computer Systems 22(3), 2006) is, with ``x = C/(2M)``,

    tau = sqrt(2CM) * (1 + sqrt(x)/3 + x/9) - C     for C < 2M
    tau = M                                         for C >= 2M

It is within a fraction of a percent of the exact optimum over the range that
matters, which is why the planner recommends it. Neither model knows correlated
failures (a rack, a switch), variable save times or warnings before a failure: the
result is a starting point to measure against, not a guarantee.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ckptvault.errors import UsageError
from ckptvault.planning.sizing import (
    StorageForecast,
    required_write_bytes_per_s,
    storage_forecast,
)

SECONDS_PER_HOUR = 3600.0
# A Julian year: the convention behind "MTBF in years" in field reports.
SECONDS_PER_YEAR = 365.25 * 24 * SECONDS_PER_HOUR

# exp() overflows a float past ~709; beyond that the overhead is infinite for any use.
_MAX_EXPONENT = 700.0


def require_positive(name: str, value: float) -> float:
    """``value`` if it is a finite number above zero; else a :class:`UsageError`
    naming the option ``name``."""
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{name} must be a finite number above zero, got {value!r}")
    return value


def require_non_negative(name: str, value: float) -> float:
    """``value`` if it is finite and at least zero; else a :class:`UsageError`."""
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{name} must be a finite number of at least zero, got {value!r}")
    return value


def young_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Young's first-order optimum ``sqrt(2CM)`` in seconds (Young 1974)."""
    c = require_positive("the save time", save_seconds)
    m = require_positive("the MTBF", mtbf_seconds)
    return math.sqrt(2.0 * c * m)


def daly_interval(save_seconds: float, mtbf_seconds: float) -> float:
    """Daly's higher-order optimum in seconds (Daly 2006): the formula in the
    module docstring for ``C < 2M``, and ``M`` itself for ``C >= 2M`` (a save so slow
    that the perturbation series no longer applies)."""
    c = require_positive("the save time", save_seconds)
    m = require_positive("the MTBF", mtbf_seconds)
    if c >= 2.0 * m:
        return m
    x = c / (2.0 * m)
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - c


def overhead_fraction(
    interval_seconds: float, save_seconds: float, mtbf_seconds: float, restart_seconds: float = 0.0
) -> float:
    """Expected extra wall-clock time per second of useful work when saving every
    ``interval_seconds`` (Daly's full model, module docstring); ``inf`` when the
    interval is so long against the MTBF that the run practically never finishes."""
    tau = require_positive("the interval", interval_seconds)
    c = require_positive("the save time", save_seconds)
    m = require_positive("the MTBF", mtbf_seconds)
    r = require_non_negative("the restart time", restart_seconds)
    exponent = (tau + c) / m
    if exponent + r / m > _MAX_EXPONENT:
        return math.inf
    # expm1 keeps the precision that e^x - 1 loses when tau + C is small against M.
    return m * math.exp(r / m) * math.expm1(exponent) / tau - 1.0


def first_order_overhead_fraction(
    interval_seconds: float, save_seconds: float, mtbf_seconds: float, restart_seconds: float = 0.0
) -> float:
    """The first-order model ``C/tau + (tau/2 + R)/M`` that Young minimized: easy to
    check by hand, and close to :func:`overhead_fraction` while ``C, tau << M``."""
    tau = require_positive("the interval", interval_seconds)
    c = require_positive("the save time", save_seconds)
    m = require_positive("the MTBF", mtbf_seconds)
    r = require_non_negative("the restart time", restart_seconds)
    return c / tau + (tau / 2.0 + r) / m


def lost_work_seconds(interval_seconds: float, restart_seconds: float = 0.0) -> float:
    """Expected wall-clock lost to one failure: half an interval of work done again
    (a failure lands uniformly within the interval) plus the restart."""
    tau = require_positive("the interval", interval_seconds)
    return tau / 2.0 + require_non_negative("the restart time", restart_seconds)


def seconds_to_steps(seconds: float, step_seconds: float) -> float:
    """``seconds`` of training expressed in steps of ``step_seconds`` each."""
    return require_non_negative("the duration", seconds) / require_positive(
        "the step time", step_seconds
    )


def interval_steps(interval_seconds: float, step_seconds: float) -> int:
    """The interval as a whole number of steps to pass to ``save()``: the nearest,
    and at least one (a step slower than the interval means save every step)."""
    steps = seconds_to_steps(interval_seconds, step_seconds)
    if not math.isfinite(steps):
        raise UsageError(f"the step time {step_seconds!r} s is too small to count steps with")
    return max(1, round(steps))


def job_mtbf_seconds(nodes: int, node_mtbf_years: float) -> float:
    """The job's MTBF when any one of ``nodes`` independent nodes failing stops it:
    ``node MTBF / nodes`` (failure rates of independent parts add)."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise UsageError(f"--nodes must be a whole number of at least 1, got {nodes!r}")
    years = require_positive("--node-mtbf-years", node_mtbf_years)
    return years * SECONDS_PER_YEAR / nodes


@dataclass(frozen=True)
class PlanInputs:
    """What the planner knows; ``None`` where it was not given. Seconds throughout;
    ``checkpoint_bytes`` from ``--params`` or a store; ``keep`` maps tier to
    generations kept (:func:`ckptvault.planning.sizing.parse_keep`)."""

    save_seconds: float | None = None
    mtbf_seconds: float | None = None
    restore_seconds: float = 0.0
    step_seconds: float | None = None
    checkpoint_bytes: int | None = None
    stall_seconds: float | None = None
    keep: Mapping[str, int] = field(default_factory=dict)
    max_in_flight: int = 1


@dataclass(frozen=True)
class CadencePlan:
    """The planner's answers; ``None`` where the inputs do not determine one.

    ``interval_s`` is the recommendation (Daly's estimate); overhead and lost work
    are given at it. ``sustained_write_bytes_per_s`` is what storage must take for
    saves to keep up with the interval (``bytes / interval``); ``warnings`` are
    sentences about inputs outside the models' comfort zone."""

    inputs: PlanInputs
    young_interval_s: float | None = None
    daly_interval_s: float | None = None
    interval_steps: int | None = None
    young_interval_steps: int | None = None
    overhead_fraction: float | None = None
    young_overhead_fraction: float | None = None
    lost_work_s: float | None = None
    lost_work_steps: float | None = None
    required_write_bytes_per_s: float | None = None
    sustained_write_bytes_per_s: float | None = None
    storage: StorageForecast | None = None
    warnings: tuple[str, ...] = ()

    @property
    def interval_s(self) -> float | None:
        return self.daly_interval_s

    def to_json(self) -> dict[str, object]:
        """Every key always present (``null`` when not determined), for scripts."""
        given = self.inputs
        return {
            "save_seconds": given.save_seconds,
            "mtbf_s": given.mtbf_seconds,
            "restore_seconds": given.restore_seconds,
            "step_seconds": given.step_seconds,
            "young_interval_s": self.young_interval_s,
            "daly_interval_s": self.daly_interval_s,
            "interval_s": self.interval_s,
            "interval_steps": self.interval_steps,
            "young_interval_steps": self.young_interval_steps,
            "overhead_fraction": self.overhead_fraction,
            "young_overhead_fraction": self.young_overhead_fraction,
            "lost_work_s": self.lost_work_s,
            "lost_work_steps": self.lost_work_steps,
            "checkpoint_bytes": given.checkpoint_bytes,
            "stall_seconds": given.stall_seconds,
            "required_write_bytes_per_s": self.required_write_bytes_per_s,
            "sustained_write_bytes_per_s": self.sustained_write_bytes_per_s,
            "storage": None if self.storage is None else self.storage.to_json(),
            "warnings": list(self.warnings),
        }


def plan_cadence(inputs: PlanInputs) -> CadencePlan:
    """Everything the inputs determine: intervals (with both C and M), steps (with
    the step time too), bandwidth (with a size and a stall), storage (with a size
    and ``keep``). Raises :class:`UsageError` for a value out of range."""
    size = inputs.checkpoint_bytes
    plan = CadencePlan(inputs)
    if inputs.save_seconds is not None and inputs.mtbf_seconds is not None:
        plan = _with_intervals(plan, inputs.save_seconds, inputs.mtbf_seconds)
    if size is not None and inputs.stall_seconds is not None:
        bandwidth = required_write_bytes_per_s(size, inputs.stall_seconds)
        plan = replace(plan, required_write_bytes_per_s=bandwidth)
    if size is not None and inputs.keep:
        forecast = storage_forecast(size, inputs.keep, inputs.max_in_flight)
        plan = replace(plan, storage=forecast)
    return plan


def _with_intervals(plan: CadencePlan, c: float, m: float) -> CadencePlan:
    """``plan`` with the intervals and what they cost, in seconds and in steps."""
    given, r = plan.inputs, plan.inputs.restore_seconds
    young, daly = young_interval(c, m), daly_interval(c, m)
    warnings = list(plan.warnings)
    if c >= 2.0 * m:
        warnings.append(
            "a save takes at least twice the MTBF: Daly's estimate falls back to the MTBF "
            "itself and the run will hardly progress; make saves faster (asynchronous "
            "saves, faster storage) before tuning the interval"
        )
    step = given.step_seconds
    if step is not None and step > daly:
        warnings.append(
            "one step takes longer than the interval: save after every step, and make "
            "saves or steps shorter"
        )
    size = given.checkpoint_bytes
    return replace(
        plan,
        young_interval_s=young,
        daly_interval_s=daly,
        overhead_fraction=overhead_fraction(daly, c, m, r),
        young_overhead_fraction=overhead_fraction(young, c, m, r),
        lost_work_s=lost_work_seconds(daly, r),
        interval_steps=None if step is None else interval_steps(daly, step),
        young_interval_steps=None if step is None else interval_steps(young, step),
        lost_work_steps=None if step is None else seconds_to_steps(daly / 2.0 + r, step),
        sustained_write_bytes_per_s=None if size is None else size / daly,
        warnings=tuple(warnings),
    )
