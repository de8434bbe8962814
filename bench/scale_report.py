"""Tables, growth slopes and the plot of the scaling benchmark (``bench.scale``).

Every table is Markdown, as the README shows it. A cost's growth is the slope of a
least-squares line through its (size, best seconds) points on log-log axes: about 1
is linear, about 0 constant, 2 quadratic.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.scale_ranks import MANIFEST_TARGET, RankPoint
from bench.scale_tensors import FIRST_SAVE, RESTORES, SAVES, Point

# (ckptvault row, the row it is compared with, the bound at TARGET_COUNT tensors)
RATIOS = (
    (SAVES[3], SAVES[0], 1.5),
    (RESTORES[3], RESTORES[0], 1.2),
)
TARGET_COUNT = 10_000


def slope(sizes: Sequence[float], costs: Sequence[float]) -> float | None:
    """The log-log least-squares slope; None with fewer than two usable points."""
    points = [
        (math.log(x), math.log(y)) for x, y in zip(sizes, costs, strict=True) if x > 0 and y > 0
    ]
    if len({x for x, _ in points}) < 2:
        return None
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread


def growth(value: float | None) -> str:
    if value is None:
        return "n/a (one size)"
    if value < 0.25:
        words = "about constant"
    elif value < 0.8:
        words = "sublinear"
    elif value <= 1.2:
        words = "linear"
    elif value <= 1.7:
        words = "superlinear"
    else:
        words = "quadratic or worse"
    return f"slope {value:.2f} ({words})"


def _cell(runs: list[float] | None) -> str:
    if not runs:
        return "-"
    best, median = min(runs), statistics.median(runs)
    return f"{best:.3f}" if len(runs) == 1 else f"{best:.3f} ({median:.3f})"


def _ratio_cell(ours: list[float] | None, theirs: list[float] | None) -> str:
    if not ours or not theirs:
        return "-"
    best = min(ours) / min(theirs)
    median = statistics.median(ours) / statistics.median(theirs)
    return f"{best:.2f}x" if len(ours) == 1 else f"{best:.2f}x ({median:.2f}x)"


def ratio(point: Point, fs: str, layout: str, ours: str, theirs: str) -> float | None:
    """Best-run ratio of ``ours`` to ``theirs`` at one point (None if not measured)."""
    mine, other = point.seconds.get((fs, layout, ours)), point.seconds.get((fs, layout, theirs))
    return min(mine) / min(other) if mine and other else None


def tensor_table(points: list[Point], fs: str, title: str) -> list[str]:
    """Seconds, best (median), of every operation at every tensor count on ``fs``."""
    counts = [p.count for p in points]
    lines = [
        title,
        "",
        "| operation | layout | " + " | ".join(f"{n:,} tensors" for n in counts) + " | growth |",
        "|---|---|" + "---:|" * len(counts) + "---|",
    ]
    layouts = sorted({k[1] for p in points for k in p.seconds if k[0] == fs})
    for layout in layouts:
        for row in (*SAVES, FIRST_SAVE, *RESTORES):
            runs = [p.seconds.get((fs, layout, row)) for p in points]
            if not any(runs):
                continue
            measured = [(p.count, min(r)) for p, r in zip(points, runs, strict=True) if r]
            fit = slope([n for n, _ in measured], [s for _, s in measured])
            cells = " | ".join(_cell(r) for r in runs)
            lines.append(f"| {row} | {layout} | {cells} | {growth(fit)} |")
        for ours, theirs, _bound in RATIOS:
            cells = " | ".join(
                _ratio_cell(p.seconds.get((fs, layout, ours)), p.seconds.get((fs, layout, theirs)))
                for p in points
            )
            lines.append(f"| **{ours} / {theirs}** | {layout} | {cells} | |")
    return lines


def verdicts(points: list[Point]) -> list[str]:
    """The issue's targets at 10,000 tensors, judged on best runs."""
    lines = []
    for point in (p for p in points if p.count == TARGET_COUNT):
        for fs, layout in sorted({(k[0], k[1]) for k in point.seconds}):
            for ours, theirs, bound in RATIOS:
                value = ratio(point, fs, layout, ours, theirs)
                if value is not None:
                    met = "met" if value <= bound else "NOT met"
                    lines.append(
                        f"- {fs}, {layout}: {ours} = {value:.2f}x {theirs} at "
                        f"{TARGET_COUNT:,} tensors (target at most {bound}x): {met}"
                    )
    return lines or [f"- the {TARGET_COUNT:,}-tensor point was not measured"]


def memory_table(results: list[dict[str, int]]) -> list[str]:
    lines = [
        "| contender | tensors | data MB | save: peak RSS growth MB | per tensor | "
        "restore: peak RSS growth MB |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        per_tensor = r["save_growth"] / r["count"]
        lines.append(
            f"| {r['contender']} | {r['count']:,} | {r['data_bytes'] / 1e6:.0f} | "
            f"{r['save_growth'] / 1e6:.0f} | {per_tensor:,.0f} B | {r['restore_growth'] / 1e6:.0f} |"
        )
    return lines


def rank_table(points: list[RankPoint]) -> list[str]:
    lines = [
        "| ranks | write items | files | indexes | global plan s | manifest build+encode s "
        "| root | of which (MB) | a rank's indexes | all indexes | rank 0 parses s | saveable |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for p in points:
        own = sum(size for name, size in p.documents.items() if name != "manifest.json")
        parts = ", ".join(f"{name} {size / 1e6:.2f}" for name, size in p.sections.items())
        saveable = "yes" if p.writable else "no: root over its cap"
        lines.append(
            f"| {p.ranks:,} | {p.items:,} | {p.files:,} | {p.indexes:,} | {p.plan_s:.3f} "
            f"| {p.encode_s:.3f} | {p.root_bytes / 1e6:.2f} MB | {parts} "
            f"| {own / 1e6:.2f} MB ({len(p.documents) - 1}) | {p.index_bytes / 1e6:.1f} MB "
            f"| {p.parse_s:.3f} | {saveable} |"
        )
    lines.append("")
    # Growth at scale: one rank writes plain tensors (nothing to dedup or validate).
    many = [p for p in points if p.ranks > 1]
    fitted = many if len(many) > 1 else points
    if len(fitted) > 1:
        ranks = [p.ranks for p in fitted]
        span = f"{ranks[0]:,}-{ranks[-1]:,} ranks"
        for label, values in (
            ("global plan", [p.plan_s for p in fitted]),
            ("root manifest bytes", [float(p.root_bytes) for p in fitted]),
            ("bytes a rank reads", [float(p.read_bytes) for p in fitted]),
            ("manifest build+encode (all indexes)", [p.encode_s for p in fitted]),
            ("rank 0's parse and checks", [p.parse_s for p in fitted]),
        ):
            lines.append(f"- {label} grows with ranks ({span}): {growth(slope(ranks, values))}")
    biggest = max(points, key=lambda p: p.ranks)
    verdict = "met" if biggest.root_bytes < MANIFEST_TARGET else "NOT met"
    lines.append(
        f"- the root at {biggest.ranks:,} ranks x {biggest.parameters} parameters: "
        f"{biggest.root_bytes / 1e6:.2f} MB (target: under 1 MB): {verdict}; rank 0 reads "
        f"{biggest.read_bytes / 1e6:.2f} MB in all ({len(biggest.documents)} documents)"
    )
    return lines


def generation_table(by_count: dict[int, dict[str, float]]) -> list[str]:
    counts = sorted(by_count)
    operations = list(by_count[counts[0]])
    lines = [
        "| operation | " + " | ".join(f"{n:,} generations" for n in counts) + " | growth |",
        "|---|" + "---:|" * len(counts) + "---|",
    ]
    for op in operations:
        values = [by_count[n].get(op) for n in counts]
        fit = slope([n for n, v in zip(counts, values, strict=True) if v], [v for v in values if v])
        cells = " | ".join("-" if v is None else f"{v:.3f}" for v in values)
        lines.append(f"| {op} | {cells} | {growth(fit)} |")
    return lines


def plot(results: dict[str, Any], points: list[Point], path: Path) -> str:
    """Cost against size on log-log axes, one panel per axis; a note when skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    figure, axes = plt.subplots(2, 2, figsize=(13, 10))
    for ax, fs in zip(axes[0], ("disk", "tmpfs"), strict=True):
        _plot_tensors(ax, points, fs)
    _plot_ranks(axes[1][0], results.get("ranks", []))
    _plot_generations(axes[1][1], results.get("generations", {}))
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return f"plot: {path}"


_COLOURS = {"torch": "C0", "safetensors": "C1", "DCP": "C2", "ckptvault": "C3"}


def _plot_tensors(ax: Any, points: list[Point], fs: str) -> None:
    """Save (solid) and restore (dashed) of each contender, flat layout, on ``fs``."""
    for row in (*SAVES, *RESTORES):
        measured = [(p.count, min(p.seconds[fs, "flat", row])) for p in points
                    if (fs, "flat", row) in p.seconds]  # fmt: skip
        if not measured:
            continue
        colour = _COLOURS[row.split(".")[0].split(" ")[0]]
        style = "-o" if row in SAVES else "--s"
        ax.plot(*zip(*measured, strict=True), style, color=colour, label=row)
    ax.set(xscale="log", yscale="log", xlabel="tensors (256 float32 each)", ylabel="seconds")
    ax.set_title(f"save (solid) and restore (dashed) vs tensor count, {fs}")
    if ax.lines:
        ax.legend(fontsize=7)


def _plot_ranks(ax: Any, points: list[dict[str, Any]]) -> None:
    if not points:
        return
    ranks = [p["ranks"] for p in points]
    for key, label in (("plan_s", "global plan"), ("encode_s", "manifest build+encode"),
                       ("parse_s", "manifest parse")):  # fmt: skip
        ax.plot(ranks, [p[key] for p in points], marker="o", label=f"{label} (s)")
    ax.plot(ranks, [sum(p["documents"].values()) / 1e6 for p in points], "k--", marker="s",
            label="manifest a rank reads (MB)")  # fmt: skip
    ax.axhline(MANIFEST_TARGET / 1e6, color="grey", linewidth=0.8, label="1 MB target")
    ax.set(xscale="log", yscale="log", xlabel="simulated ranks", ylabel="seconds / MB")
    ax.set_title("DCP metadata vs rank count")
    ax.legend(fontsize=7)


def _plot_generations(ax: Any, by_count: dict[int, dict[str, float]]) -> None:
    if not by_count:
        return
    counts = sorted(by_count)
    for op in by_count[counts[0]]:
        values = [(n, by_count[n][op]) for n in counts if by_count[n].get(op)]
        ax.plot(*zip(*values, strict=True), marker="o", label=op)
    ax.set(xscale="log", yscale="log", xlabel="generations in the store", ylabel="seconds")
    ax.set_title("listing and discovery vs generation count")
    ax.legend(fontsize=7)
