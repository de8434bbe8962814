"""How big a checkpoint is, how fast it must be written, and how much storage it takes.

Pure functions, no I/O; ``ckptvault plan`` uses them beside
:mod:`ckptvault.planning.cadence`.

Size: parameters × bytes per parameter, with named recipes for the usual training
setups (:data:`RECIPES`). The recipes count what a checkpoint holds: weights,
master weights and optimizer moments; gradients are recomputed, never saved. RNG
states, counters and the data-loader position are small and left out.

Bandwidth: a blocking save of ``B`` bytes that may stall training ``S`` seconds
needs ``B / S`` bytes per second to storage. An asynchronous save stalls only for
the copy into host memory, so ``B / S`` is then the copy bandwidth, and storage
has to take ``B`` within one interval (``B / interval``) to keep up.

Storage per tier: while generation ``K+1`` is written, the ``K`` kept ones are
still there, so a tier peaks at ``(kept + in flight) × size``; asynchronous saves
also hold ``in flight × size`` of staged copies in host memory. Generations that
retention marked stay until their ``delete_delay`` passes: add them when the
delay is longer than an interval.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckptvault.errors import UsageError

# name -> (bytes per parameter, what it counts)
RECIPES: dict[str, tuple[float, str]] = {
    "bf16-weights": (2.0, "bf16 weights only (an inference export)"),
    "fp32-weights": (4.0, "fp32 weights only"),
    "mixed-adam-8bit": (8.0, "bf16 weights 2 + fp32 master 4 + 8-bit Adam moments 2"),
    "fp32-adam": (12.0, "fp32 weights 4 + Adam moments 8 (two fp32 buffers)"),
    "mixed-adam": (14.0, "bf16 weights 2 + fp32 master 4 + Adam moments 8"),
}

_SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}
_COUNT = re.compile(r"(?P<number>[0-9][0-9_]*(?:\.[0-9]+)?(?:e[+]?[0-9]+)?)(?P<suffix>[kmbgt]?)")
_KEEP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_KEEP_COUNT = re.compile(r"[0-9]{1,9}")
DEFAULT_TIER = "store"


def parse_count(text: str, what: str = "--params") -> int:
    """A positive count written as ``70000000000``, ``70_000_000_000``, ``70e9``,
    ``7.5e9`` or with a suffix ``K``/``M``/``B`` (or ``G``)/``T`` (``70B``, ``1.5T``)."""
    match = _COUNT.fullmatch(text.strip().lower())
    if match is None:
        raise UsageError(
            f"{what} {text!r} is not a count: write it like 70e9, 70B, 7.5B or 70000000000"
        )
    value = float(match["number"].replace("_", "")) * _SUFFIXES[match["suffix"]]
    if not math.isfinite(value) or value < 1:
        raise UsageError(f"{what} must be at least 1, got {text!r}")
    return round(value)


def bytes_per_param(recipe: str | None, explicit: float | None) -> float | None:
    """Bytes per parameter from ``--recipe`` or ``--bytes-per-param`` (one of them, or
    neither: ``None``)."""
    if recipe is not None and explicit is not None:
        raise UsageError("give --recipe or --bytes-per-param, not both")
    if explicit is not None:
        if not math.isfinite(explicit) or explicit <= 0:
            raise UsageError(f"--bytes-per-param must be above zero, got {explicit!r}")
        return explicit
    if recipe is None:
        return None
    if recipe not in RECIPES:
        raise UsageError(f"unknown --recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[recipe][0]


def checkpoint_bytes(params: int, per_param: float) -> int:
    """The checkpoint size in bytes: ``params × per_param``, rounded up."""
    if params < 1 or not math.isfinite(per_param) or per_param <= 0:
        raise UsageError(
            f"a checkpoint size needs parameters >= 1 and bytes per parameter > 0, "
            f"got {params!r} and {per_param!r}"
        )
    size = params * per_param
    if not math.isfinite(size):
        raise UsageError(f"{params} parameters × {per_param} bytes is too large to size")
    return math.ceil(size)


def required_write_bytes_per_s(size_bytes: int, stall_seconds: float) -> float:
    """The bandwidth that writes ``size_bytes`` within ``stall_seconds``."""
    if not math.isfinite(stall_seconds) or stall_seconds <= 0:
        raise UsageError(f"--stall-seconds must be above zero, got {stall_seconds!r}")
    return size_bytes / stall_seconds


def parse_keep(values: Sequence[str]) -> dict[str, int]:
    """Generations kept per tier from ``--keep`` values: one plain count (a single
    tier, called ``store``) or ``TIER=COUNT`` once per tier (``local=3``, ``s3=10``)."""
    kept: dict[str, int] = {}
    for value in values:
        name, sep, count_text = value.rpartition("=")
        name = name.strip() if sep else DEFAULT_TIER
        if sep and _KEEP_NAME.fullmatch(name) is None:
            raise UsageError(f"--keep {value!r}: name the tier with letters, digits, ._- (local=3)")
        if _KEEP_COUNT.fullmatch(count_text.strip()) is None or int(count_text) < 1:
            raise UsageError(
                f"--keep {value!r}: the count of generations kept must be a whole number "
                "of at least 1 (--keep 3, or --keep local=3 --keep s3=10)"
            )
        if name in kept:
            raise UsageError(
                f"--keep names tier {name!r} twice; give one count per tier "
                "(a plain count is one tier; name tiers to give several)"
            )
        kept[name] = int(count_text)
    return kept


@dataclass(frozen=True)
class TierForecast:
    """One tier's peak: ``(kept + in_flight) × size`` bytes."""

    tier: str
    kept: int
    in_flight: int
    bytes: int

    def to_json(self) -> dict[str, object]:
        return {"kept": self.kept, "in_flight": self.in_flight, "bytes": self.bytes}


@dataclass(frozen=True)
class StorageForecast:
    """Peak storage per tier, their total, and the host memory asynchronous saves
    stage into (``staging_bytes``)."""

    tiers: tuple[TierForecast, ...]
    staging_bytes: int

    @property
    def total_bytes(self) -> int:
        return sum(tier.bytes for tier in self.tiers)

    def to_json(self) -> dict[str, object]:
        return {
            "tiers": {tier.tier: tier.to_json() for tier in self.tiers},
            "total_bytes": self.total_bytes,
            "staging_bytes": self.staging_bytes,
        }


def storage_forecast(
    size_bytes: int, kept: Mapping[str, int], max_in_flight: int = 1
) -> StorageForecast:
    """The peak each tier reaches while ``max_in_flight`` saves are written into it
    beside the ``kept[tier]`` generations retention keeps (module docstring)."""
    if isinstance(max_in_flight, bool) or max_in_flight < 1:
        raise UsageError(f"--max-in-flight must be at least 1, got {max_in_flight!r}")
    if size_bytes < 0:
        raise UsageError(f"a checkpoint size cannot be negative, got {size_bytes!r}")
    tiers = tuple(
        TierForecast(name, count, max_in_flight, (count + max_in_flight) * size_bytes)
        for name, count in kept.items()
    )
    return StorageForecast(tiers, max_in_flight * size_bytes)
