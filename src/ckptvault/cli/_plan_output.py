"""How ``ckptvault plan`` shows a plan: a table for people, a plot of the trade-off.

matplotlib is an optional extra (``pip install 'ckptvault[plot]'``), imported only
when a plot is asked for, so the planner itself needs nothing beyond the CLI's
own dependencies.
"""

from __future__ import annotations

import math
from pathlib import Path

from ckptvault.cli._common import err, out, print_table, safe_markup
from ckptvault.errors import UsageError
from ckptvault.planning.cadence import (
    CadencePlan,
    first_order_overhead_fraction,
    overhead_fraction,
)

_PLOT_FORMATS = (".png", ".svg", ".pdf")
_PLOT_POINTS = 400
_PLOT_SPAN = 30.0  # the curve spans the optimum divided and multiplied by this


def duration(seconds: float) -> str:
    """``seconds`` the way people read durations: 45.0 s, 8 min 50 s, 21 h 2 min."""
    if not math.isfinite(seconds):
        return "∞"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {round(seconds % 60)} s"
    if seconds < 48 * 3600:
        return f"{int(seconds // 3600)} h {round(seconds % 3600 / 60)} min"
    return f"{seconds / 86400:.1f} d"


def decimal_bytes(count: float, unit: str = "B") -> str:
    """A size in decimal units (GB = 10^9 bytes), as storage and network are sold."""
    for prefix in ("", "k", "M", "G", "T", "P"):
        if abs(count) < 1000 or prefix == "P":
            return f"{count:.3g} {prefix}{unit}"
        count /= 1000
    return f"{count} {unit}"  # pragma: no cover (the loop returns at "P")


def _steps(steps: float | None) -> str:
    return "" if steps is None else f" ({steps:,.1f} steps)"


def print_plan(
    plan: CadencePlan, size_note: str | None, sources: dict[str, str | None], plot: Path | None
) -> None:
    """The plan as a two-column table on stdout; warnings on stderr."""
    rows = _interval_rows(plan, sources) + _size_rows(plan, size_note)
    print_table(("quantity", "value"), rows, header=False)
    if plot is not None:
        out.print(f"plot written to {safe_markup(plot)}")
    for warning in plan.warnings:
        err.print(f"warning: {safe_markup(warning)}")


def _interval_rows(plan: CadencePlan, sources: dict[str, str | None]) -> list[tuple[str, str]]:
    given = plan.inputs
    c, m, young, daly = (
        given.save_seconds,
        given.mtbf_seconds,
        plan.young_interval_s,
        plan.daly_interval_s,
    )
    if c is None or m is None or young is None or daly is None:
        return []
    return [
        ("save cost C", f"{duration(c)}  [{sources['save_seconds']}]"),
        ("MTBF M", f"{duration(m)}  [{sources['mtbf_s']}]"),
        ("restart R", duration(given.restore_seconds)),
        ("Young sqrt(2CM)", duration(young) + _interval(plan.young_interval_steps)),
        ("Daly (recommended)", duration(daly) + _interval(plan.interval_steps)),
        ("expected overhead", f"{100 * (plan.overhead_fraction or 0.0):.2f} %"),
        ("lost work / failure", duration(plan.lost_work_s or 0.0) + _steps(plan.lost_work_steps)),
    ]


def _size_rows(plan: CadencePlan, size_note: str | None) -> list[tuple[str, str]]:
    given, rows = plan.inputs, []
    if given.checkpoint_bytes is not None:
        rows.append(("checkpoint size", f"{decimal_bytes(given.checkpoint_bytes)}  [{size_note}]"))
    if plan.required_write_bytes_per_s is not None:
        stall = duration(given.stall_seconds or 0.0)
        bandwidth = decimal_bytes(plan.required_write_bytes_per_s, "B/s")
        rows.append(
            (
                f"write for a {stall} stall",
                f"{bandwidth} (blocking save; async: host-copy bandwidth)",
            )
        )
    if plan.sustained_write_bytes_per_s is not None:
        bandwidth = decimal_bytes(plan.sustained_write_bytes_per_s, "B/s")
        rows.append(("keep-up write", f"{bandwidth} (size / interval)"))
    if plan.storage is not None:
        for tier in plan.storage.tiers:
            held = f"({tier.kept} kept + {tier.in_flight} in flight)"
            rows.append((f"storage {tier.tier}", f"{decimal_bytes(tier.bytes)} {held}"))
        staging = decimal_bytes(plan.storage.staging_bytes)
        rows.append(("async staging", f"{staging} host memory"))
    return rows


def _interval(steps: int | None) -> str:
    return "" if steps is None else f" (every {steps:,} steps)"


def write_overhead_plot(plan: CadencePlan, path: Path) -> None:
    """Draw expected overhead against the interval (log x axis) into ``path``
    (.png, .svg or .pdf), with Young's and Daly's intervals marked."""
    given = plan.inputs
    c, m, r = given.save_seconds, given.mtbf_seconds, given.restore_seconds
    young, daly = plan.young_interval_s, plan.daly_interval_s
    if c is None or m is None or young is None or daly is None:
        raise UsageError("--plot draws the interval trade-off: give the save cost and the MTBF")
    if path.suffix.lower() not in _PLOT_FORMATS:
        raise UsageError(f"--plot {path}: name a {', '.join(_PLOT_FORMATS)} file")
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise UsageError(
            "--plot needs matplotlib: pip install 'ckptvault[plot]' (or leave out --plot)"
        ) from None
    low, high = daly / _PLOT_SPAN, daly * _PLOT_SPAN
    xs = [low * (high / low) ** (i / (_PLOT_POINTS - 1)) for i in range(_PLOT_POINTS)]
    exact = [100 * overhead_fraction(x, c, m, r) for x in xs]
    first = [100 * first_order_overhead_fraction(x, c, m, r) for x in xs]
    # A Figure without pyplot: no global state, no display backend needed.
    figure = Figure(figsize=(8, 5), layout="constrained")
    axes = figure.subplots()
    axes.plot(xs, exact, label="expected overhead (Daly's model)")
    axes.plot(xs, first, linestyle="--", label="first order: C/τ + (τ/2 + R)/M")
    for name, tau, colour in (("Young", young, "tab:green"), ("Daly", daly, "tab:red")):
        value = 100 * overhead_fraction(tau, c, m, r)
        axes.axvline(tau, color=colour, linestyle=":")
        axes.plot(
            [tau], [value], "o", color=colour, label=f"{name}: {duration(tau)}, {value:.2f} %"
        )
    axes.set_xscale("log")
    finite = [y for y in exact if math.isfinite(y)]
    axes.set_ylim(0, min(max(finite), 4 * min(finite)))
    axes.set_xlabel("checkpoint interval τ (seconds, log scale)")
    axes.set_ylabel("overhead (% of useful work)")
    axes.set_title(f"C = {duration(c)}, M = {duration(m)}, R = {duration(r)}")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.savefig(path, format=path.suffix.lower().lstrip("."))
