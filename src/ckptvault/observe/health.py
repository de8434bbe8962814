"""A store's health, from its listing and the catalog: what ``ckptvault status`` prints.

The thresholds are the alert thresholds of the field guide (seed 002, "Monitoring and
runbooks"), the same ones ``contrib/alerts.yml`` puts on the manager's Prometheus
metrics; each warning names the alert (and runbook entry, in the operations guide
``docs/guides/operations.md``) it matches:

======================================  ==================  ============================
measure                                 healthy             warning
======================================  ==================  ============================
last good checkpoint age                < 1.5 x cadence     > 2 x cadence (or none)
save duration p50 (total)               < 30 s              > 60 s
save duration p99                       < 2 x p50           > 3 x p50 (and > 1 s)
save success rate                       > 99.5 %            < 99 %
filesystem used (POSIX store)           < 75 %              > 85 %
replication lag                         < 1 h               > 4 h
a failed write                          -                   while <= 1 generation remains
======================================  ==================  ============================

The cadence is the one given, or the median interval between recent successful
saves (the catalog's, else the listed generations'). Nothing here verifies bytes:
"generation" means published and not marked for deletion (``ckptvault verify``
checks them).
"""

from __future__ import annotations

import itertools
import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptvault.observe.catalog import Catalog, GenerationRecord, SaveRecord, store_key
from ckptvault.observe.usage import (
    FilesystemUse,
    created_epoch,
    is_future_dated,
    replicated_ids,
    replication_lag,
    store_usage,
)
from ckptvault.storage.base import Store
from ckptvault.storage.listing import GenerationInfo

logger = logging.getLogger("ckptvault")

AGE_OVER_CADENCE = 2.0
STORAGE_USED_FRACTION = 0.85
SAVE_P50_SECONDS = 60.0
P99_OVER_P50 = 3.0
# A tail under a second is jitter (the first save allocates buffers), not a stall.
TAIL_MIN_SECONDS = 1.0
SUCCESS_RATE = 0.99
REPLICATION_LAG_SECONDS = 4 * 3600.0
REPLICATION_HEALTHY_SECONDS = 3600.0
RECENT_SAVES = 100  # the window of saves latency and success rate are computed over


@dataclass(frozen=True)
class HealthWarning:
    """One threshold crossed: ``alert`` is the matching rule in ``contrib/alerts.yml``
    and the runbook heading in ``docs/guides/operations.md`` (its anchor there is
    ``alert.lower()``)."""

    alert: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"alert": self.alert, "message": self.message}


@dataclass(frozen=True)
class Latency:
    """Nearest-rank percentiles of recent successful saves, seconds (None: no save)."""

    p50: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Latency:
        return cls(percentile(values, 0.50), percentile(values, 0.99))

    def to_json(self) -> dict[str, float | None]:
        return {"p50": self.p50, "p99": self.p99}


@dataclass(frozen=True)
class Finished:
    """A finished run: the step and generation its DONE record names (checked against
    the store), when it was written, and where the record is."""

    step: int
    generation_id: str
    written_at: str
    record: str

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "generation_id": self.generation_id,
            "written_at": self.written_at,
            "record": self.record,
        }


@dataclass
class HealthReport:
    """What ``status`` found; ``warnings`` empty means healthy. Ages and durations in
    seconds, times in Unix seconds; None where the store and catalog cannot tell."""

    store: str
    catalog: str | None
    checked_at: float
    run_id: str | None = None  # of the newest save the catalog recorded here
    generations: int = 0
    last_good_step: int | None = None
    last_good_age_s: float | None = None
    last_validated_age_s: float | None = None
    cadence_s: float | None = None
    cadence_source: str | None = None  # "given", "saves" or "generations"
    recent_saves: int = 0
    failed_saves: int = 0
    save_total_s: Latency = field(default_factory=lambda: Latency(None, None))
    save_stall_s: Latency = field(default_factory=lambda: Latency(None, None))
    storage_bytes: dict[str, int] = field(default_factory=dict)  # tier location -> bytes
    # Generations retention marked for deletion: their bytes stay until the delete delay.
    marked_generations: int = 0
    marked_bytes: int = 0
    filesystem: FilesystemUse | None = None
    replication_lag_s: float | None = None
    last_save_failed: bool = False
    warnings: list[HealthWarning] = field(default_factory=list)
    # This node's memory tier of the run, when ``status`` found one.
    memory_tier: str | None = None
    memory_step: int | None = None
    memory_age_s: float | None = None
    # The run finished: its DONE record (``status --done-file``) matched the store.
    finished: Finished | None = None

    @property
    def success_rate(self) -> float | None:
        if not self.recent_saves:
            return None
        return (self.recent_saves - self.failed_saves) / self.recent_saves

    @property
    def healthy(self) -> bool:
        return not self.warnings

    def to_json(self) -> dict[str, Any]:
        rate = self.success_rate
        lag = self.replication_lag_s
        return {
            "store": self.store,
            "catalog": self.catalog,
            "checked_at": self.checked_at,
            "healthy": self.healthy,
            "run_id": self.run_id,
            "generations": self.generations,
            "last_good_step": self.last_good_step,
            "last_good_age_s": self.last_good_age_s,
            "last_validated_age_s": self.last_validated_age_s,
            "cadence_s": self.cadence_s,
            "cadence_source": self.cadence_source,
            "saves": {
                "recent": self.recent_saves,
                "failed": self.failed_saves,
                "success_rate": rate,
                "failure_rate": None if rate is None else 1.0 - rate,
                "last_failed": self.last_save_failed,
            },
            "save_total_s": self.save_total_s.to_json(),
            "save_stall_s": self.save_stall_s.to_json(),
            "storage": {
                "tiers": dict(self.storage_bytes),
                "marked": {"generations": self.marked_generations, "bytes": self.marked_bytes},
                "filesystem": None if self.filesystem is None else self.filesystem.to_json(),
            },
            "memory": {
                "tier": self.memory_tier,
                "step": self.memory_step,
                "age_s": self.memory_age_s,
            },
            "finished": None if self.finished is None else self.finished.to_json(),
            "replication_lag_s": lag,
            "replication_healthy": None if lag is None else lag < REPLICATION_HEALTHY_SECONDS,
            "warnings": [w.to_json() for w in self.warnings],
        }


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank ``q`` percentile (0 < q <= 1); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def median_interval(times: Sequence[float]) -> float | None:
    """The median gap between successive times (None with fewer than two)."""
    ordered = sorted(times)
    gaps = [b - a for a, b in itertools.pairwise(ordered)]
    return statistics.median(gaps) if gaps else None


def check_health(
    store: Store,
    catalog_path: Path | None,
    cadence_s: float | None = None,
    now: float | None = None,
    finished: Finished | None = None,
) -> HealthReport:
    """List ``store`` and read ``catalog_path`` (when it exists) into a report with a
    warning for every threshold crossed. ``cadence_s`` overrides the cadence measured
    from recent saves. ``finished``: the run ended (its DONE record matched the
    store), so no newer checkpoint is due and the age of the last one is no warning.
    Raises what the store or catalog raise when unreadable."""
    at = time.time() if now is None else now
    usage = store_usage(store)
    saves: list[SaveRecord] = []
    recorded: list[GenerationRecord] = []
    if catalog_path is not None and catalog_path.is_file():
        key = store_key(store.location)
        with Catalog(catalog_path) as book:
            saves = book.recent_saves(key, None, RECENT_SAVES)
            recorded = book.generations(key)
    report = HealthReport(store.location, str(catalog_path) if catalog_path else None, at)
    report.finished = finished
    live = usage.live
    published = _published_times(live, recorded, at)
    live = [info for info in live if info.generation_id in published]
    report.generations = len(live)
    if live:
        newest = max(live, key=lambda info: published[info.generation_id])
        report.last_good_step = newest.step
        report.last_good_age_s = max(0.0, at - published[newest.generation_id])
    validated = [g.validated_at for g in recorded if g.validated_at is not None]
    if validated:
        report.last_validated_age_s = max(0.0, at - max(validated))
    _save_facts(report, saves, cadence_s, list(published.values()))
    report.storage_bytes = _tier_bytes(store.location, usage.used_bytes, recorded)
    marked = [info for info in usage.generations if info.marked_at is not None]
    report.marked_generations, report.marked_bytes = len(marked), sum(i.bytes for i in marked)
    report.filesystem = usage.filesystem
    copied = replicated_ids(store, live) | {g.generation_id for g in recorded if len(g.tiers) > 1}
    report.replication_lag_s = replication_lag(published.items(), copied, at)
    report.warnings = thresholds(report)
    return report


def _published_times(
    live: Sequence[GenerationInfo], recorded: list[GenerationRecord], now: float
) -> dict[str, float]:
    """When each listed generation was published: the catalog's time, else the one in
    its id. A generation dated in the future was not written by a save (it would
    pass for a checkpoint made just now, for ever): it is left out, with a warning."""
    by_id = {g.generation_id: g for g in recorded}
    published = {}
    for info in live:
        record = by_id.get(info.generation_id)
        at = record.published_at if record is not None else created_epoch(info.generation_id)
        if is_future_dated(at, now):
            logger.warning(
                "%s is dated %s, in the future: not counted as a checkpoint (planted, or "
                "written by a host whose clock is wrong; check it with ckptvault verify)",
                info.path,
                info.created_at,
            )
            continue
        published[info.generation_id] = at
    return published


def _save_facts(
    report: HealthReport, saves: list[SaveRecord], cadence_s: float | None, published: list[float]
) -> None:
    """Latency, success rate and cadence from the recent saves (newest first)."""
    ok = [s for s in saves if s.ok]
    report.recent_saves, report.failed_saves = len(saves), len(saves) - len(ok)
    report.last_save_failed = bool(saves) and not saves[0].ok
    report.run_id = saves[0].run_id if saves else None
    report.save_total_s = Latency.of([s.seconds for s in ok])
    report.save_stall_s = Latency.of([s.stall_seconds for s in ok])
    if cadence_s is not None:
        report.cadence_s, report.cadence_source = cadence_s, "given"
        return
    for source, times in (("saves", [s.finished_at for s in ok]), ("generations", published)):
        interval = median_interval(times)
        if interval is not None and interval > 0:
            report.cadence_s, report.cadence_source = interval, source
            return


def _tier_bytes(location: str, local: int, recorded: list[GenerationRecord]) -> dict[str, int]:
    """Bytes per tier: the store's from its listing, every other tier's from the
    catalog's record of what was copied there (still held by the store's generations)."""
    tiers = {location: local}
    for record in recorded:
        for tier in record.tiers:
            if tier != location:
                tiers[tier] = tiers.get(tier, 0) + record.bytes
    return tiers


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds:.3g} s"


def thresholds(report: HealthReport) -> list[HealthWarning]:
    """A warning for every threshold the report crosses (seed 002's table)."""
    found = [*_age_warnings(report), *_save_warnings(report)]
    fs = report.filesystem
    if fs is not None and fs.used_fraction > STORAGE_USED_FRACTION:
        found.append(
            HealthWarning(
                "CkptvaultStorageFilling",
                f"the filesystem of {fs.path} is {fs.used_fraction:.0%} used (over "
                f"{STORAGE_USED_FRACTION:.0%}); the next saves may fail with StorageFullError: "
                "keep fewer generations (retention) or make room",
            )
        )
    lag = report.replication_lag_s
    if lag is not None and lag > REPLICATION_LAG_SECONDS:
        found.append(
            HealthWarning(
                "CkptvaultReplicationLagging",
                f"the replica tier is {_hours(lag)} behind (over "
                f"{_hours(REPLICATION_LAG_SECONDS)}): generations newer than that exist only "
                "in the local tier; check the replicator's errors in the training log",
            )
        )
    return found


def _age_warnings(report: HealthReport) -> list[HealthWarning]:
    age, cadence = report.last_good_age_s, report.cadence_s
    if report.finished is not None and age is not None:
        return []  # a finished run saves no more: its last checkpoint ages, as it should
    if age is None:
        return [
            HealthWarning(
                "CkptvaultCheckpointStale",
                f"store {report.store} holds no checkpoint: a failure now loses all the work",
            )
        ]
    if cadence is not None and age > AGE_OVER_CADENCE * cadence:
        return [
            HealthWarning(
                "CkptvaultCheckpointStale",
                f"the last good checkpoint (step {report.last_good_step}) is {_hours(age)} old, "
                f"over {AGE_OVER_CADENCE:g}x the cadence of {_hours(cadence)} "
                f"({report.cadence_source}): saves are not being published; check the "
                "training job and its log",
            )
        ]
    return []


def _save_warnings(report: HealthReport) -> list[HealthWarning]:
    found = []
    p50, p99 = report.save_total_s.p50, report.save_total_s.p99
    if p50 is not None and p50 > SAVE_P50_SECONDS:
        found.append(
            HealthWarning(
                "CkptvaultSaveSlow",
                f"the median save takes {p50:.1f} s (over {SAVE_P50_SECONDS:g} s): the "
                "store's write bandwidth has dropped or checkpoints grew",
            )
        )
    tail = p99 is not None and p99 > TAIL_MIN_SECONDS
    if p50 is not None and p99 is not None and tail and p99 > P99_OVER_P50 * p50:
        found.append(
            HealthWarning(
                "CkptvaultSaveTail",
                f"the p99 save takes {p99:.2f} s, over {P99_OVER_P50:g}x the median "
                f"{p50:.2f} s: some saves stall (contention, throttling, a slow node)",
            )
        )
    rate = report.success_rate
    if rate is not None and rate < SUCCESS_RATE:
        found.append(
            HealthWarning(
                "CkptvaultSaveFailures",
                f"{report.failed_saves} of the last {report.recent_saves} saves failed "
                f"(success rate {rate:.1%}, under {SUCCESS_RATE:.0%}); "
                "`ckptvault catalog` lists the errors",
            )
        )
    if report.last_save_failed and report.generations <= 1:
        found.append(
            HealthWarning(
                "CkptvaultLastCheckpointAtRisk",
                f"the last save failed and store {report.store} holds "
                f"{report.generations} generation(s): one more loss and there is nothing "
                "to restore; fix the save errors now and copy the remaining generation away",
            )
        )
    return found
