"""Prometheus metrics of a manager: an event subscriber with a registry of its own.

``CheckpointManager(..., metrics=True)`` (on by default when ``prometheus-client``
is installed: ``pip install 'ckptvault[metrics]'``) counts what its events say —
saves, their blocking and total durations, bytes, failures, restores, copies to the
replica tier — into a :class:`prometheus_client.CollectorRegistry` that belongs to
that manager (``mgr.metrics_registry``): two managers in one process never share a
series, and nothing lands in the global default registry. ``metrics_port=PORT``
serves it over HTTP (``metrics_addr``, default 127.0.0.1); or mount the registry in a
server of your own.

Values that age — the last good checkpoint's age, the replication lag, storage use —
are computed when scraped, not when an event arrives, so a job that stopped saving
shows an age that keeps growing. Storage use lists the tiers; the listing is reused
for :data:`USAGE_TTL_S` seconds so that frequent scrapes do not list a bucket each
time. Only the coordinator (rank 0) of a job keeps metrics, as it alone publishes.

Names follow Prometheus conventions (``ckptvault_`` prefix, base units, ``_seconds``,
``_bytes``, ``_total``); labels are ``run_id`` and, for storage, ``tier`` (``local`` or
``replica``), for step times and stragglers ``rank``
(:mod:`ckptvault.observe.stragglers` adds those). ``contrib/alerts.yml`` holds
alerting rules on them.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from ckptvault.errors import CheckpointError, UsageError
from ckptvault.events import (
    Deleted,
    Event,
    MemorySkipped,
    Published,
    Refused,
    Replicated,
    Restored,
    SaveFailed,
    Validated,
)
from ckptvault.observe.catalog import Catalog, store_key
from ckptvault.observe.health import median_interval
from ckptvault.observe.usage import StoreUsage, created_epoch, is_future_dated, store_usage
from ckptvault.storage.base import Store

logger = logging.getLogger("ckptvault")

INSTALL_HINT = "pip install 'ckptvault[metrics]'"
# Seconds: from a memory copy (an async stall) to a slow save of a large model.
SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
USAGE_TTL_S = 60.0
CADENCE_SAMPLES = 21  # publishes whose intervals give the cadence (their median)


def import_prometheus(needed_for: str) -> ModuleType:
    """``prometheus_client``, or ``UsageError`` saying how to install it."""
    try:
        import prometheus_client
    except ImportError:
        raise UsageError(
            f"{needed_for} needs prometheus-client, which is not installed: "
            f"{INSTALL_HINT} (or pip install prometheus-client)"
        ) from None
    return prometheus_client


class ManagerMetrics:
    """The Prometheus subscriber of one manager (``registry``: its metrics only).

    Call :meth:`serve` to expose them over HTTP, :meth:`close` to stop serving.
    Thread-safe: events arrive from the caller's, the save worker's and the
    replicator's threads while scrapes read.
    """

    def __init__(
        self,
        run_id: str,
        store: Store,
        replica: Store | None = None,
        replication_lag: Callable[[], float] | None = None,
        catalog_path: Path | None = None,
    ) -> None:
        pc = import_prometheus("metrics")
        self.registry: Any = pc.CollectorRegistry()
        self.run_id, self.store, self.replica = run_id, store, replica
        self._lag, self._catalog_path = replication_lag, catalog_path
        self._lock = threading.Lock()
        self._started = time.time()
        self._validated: float | None = None  # this process's newest successful validation
        self._publishes: deque[float] = deque(maxlen=CADENCE_SAMPLES)
        self._usage: dict[str, tuple[float, StoreUsage]] = {}
        self._server: Any = None
        self.port: int | None = None
        # The memory tier's location, when the manager has one: its publishes are
        # counted apart (the durable ones keep their meaning).
        self.memory_location: str | None = None
        self._memory_saved: float | None = None
        self._seed_from_store()
        self._define(pc)
        self.registry.register(_ScrapeTime(self, pc))

    def _define(self, pc: ModuleType) -> None:
        def counter(name: str, doc: str) -> Any:
            return pc.Counter(name, doc, ["run_id"], registry=self.registry).labels(self.run_id)

        def histogram(name: str, doc: str) -> Any:
            metric = pc.Histogram(
                name, doc, ["run_id"], buckets=SECONDS_BUCKETS, registry=self.registry
            )
            return metric.labels(self.run_id)

        self._saves = counter("ckptvault_saves", "Saves published.")
        self._failures = counter(
            "ckptvault_save_failures", "Saves that failed after they were accepted."
        )
        self._bytes = counter("ckptvault_save_bytes", "Bytes of the generations published.")
        self._blocking = histogram(
            "ckptvault_save_blocking_seconds", "How long save() blocked training."
        )
        self._duration = histogram(
            "ckptvault_save_duration_seconds", "From save() being called to the publish."
        )
        self._restores = counter("ckptvault_restores", "Restores applied.")
        self._refusals = counter("ckptvault_restore_refusals", "Restores refused.")
        self._restore_seconds = histogram(
            "ckptvault_restore_duration_seconds",
            "From restore() being called to the state applied.",
        )
        self._replications = counter(
            "ckptvault_replications", "Generations copied, verified, to the replica tier."
        )
        self._deletions = counter("ckptvault_deletions", "Generations deleted by retention.")
        self._validations = counter("ckptvault_validations", "Generations loaded and checked.")
        self._validation_failures = counter(
            "ckptvault_validation_failures", "Validations that failed (load or check)."
        )
        self._memory_saves = counter(
            "ckptvault_memory_saves", "Saves published to the memory tier."
        )
        self._memory_skipped = counter(
            "ckptvault_memory_saves_skipped", "Saves the memory tier had no room for."
        )

    def _seed_from_store(self) -> None:
        """A restarted job's last good checkpoint is the newest one already there."""
        try:
            refs = self.store.list_generations()
        except (OSError, CheckpointError):
            return
        now = time.time()  # a generation dated in the future was not written by a save
        times = sorted(
            t
            for t in map(created_epoch, (r.generation_id for r in refs))
            if not is_future_dated(t, now)
        )
        self._publishes.extend(times[-CADENCE_SAMPLES:])

    def __call__(self, event: Event) -> None:
        if isinstance(event, Published) and event.store == self.memory_location:
            self._memory_saves.inc()
            with self._lock:
                self._memory_saved = time.time()
        elif isinstance(event, MemorySkipped):
            self._memory_skipped.inc()
        elif isinstance(event, Published):
            self._saves.inc()
            self._bytes.inc(event.bytes)
            self._blocking.observe(event.stall_seconds)
            self._duration.observe(event.total_seconds)
            with self._lock:
                self._publishes.append(time.time())
                self._usage.clear()  # the next scrape lists again
        elif isinstance(event, SaveFailed):
            self._failures.inc()
        elif isinstance(event, Restored):
            self._restores.inc()
            self._restore_seconds.observe(event.seconds)
        elif isinstance(event, Refused):
            self._refusals.inc()
        elif isinstance(event, Replicated):
            self._replications.inc()
            with self._lock:
                self._usage.pop("replica", None)
        elif isinstance(event, Validated):
            (self._validations if event.ok else self._validation_failures).inc()
            with self._lock:
                self._validated = time.time() if event.ok else self._validated
        elif isinstance(event, Deleted):
            self._deletions.inc()
            with self._lock:
                self._usage.clear()

    # -- read at scrape time -----------------------------------------------------------

    def last_good_age(self, now: float) -> float:
        """Seconds since the newest publish; with none yet, since the manager started
        (a job that never checkpointed ages too)."""
        with self._lock:
            last = self._publishes[-1] if self._publishes else self._started
        return max(0.0, now - last)

    def memory_save_age(self, now: float) -> float | None:
        """Seconds since the newest memory-tier publish (since start without one);
        None without a memory tier."""
        if self.memory_location is None:
            return None
        with self._lock:
            last = self._memory_saved if self._memory_saved is not None else self._started
        return max(0.0, now - last)

    def cadence(self) -> float | None:
        """The median interval between recent publishes (None before two)."""
        with self._lock:
            times = list(self._publishes)
        interval = median_interval(times)
        return interval if interval else None

    def replication_lag(self) -> float | None:
        return None if self._lag is None else self._lag()

    def usage(self, tier: str) -> StoreUsage | None:
        """A listing of ``tier`` ("local" or "replica"), at most USAGE_TTL_S old;
        None when it cannot be listed (logged: a scrape never fails for it)."""
        store = self.store if tier == "local" else self.replica
        if store is None:
            return None
        now = time.monotonic()
        with self._lock:
            cached = self._usage.get(tier)
        if cached is not None and now - cached[0] < USAGE_TTL_S:
            return cached[1]
        try:
            listed = store_usage(store)
        except (OSError, CheckpointError) as exc:
            logger.debug("metrics: could not list %s: %s", store.location, exc)
            return None
        with self._lock:
            self._usage[tier] = (now, listed)
        return listed

    def last_validated_age(self, now: float) -> float | None:
        """Seconds since the newest successful validation: this process's, or one the
        catalog recorded for this store (``ckptvault validate``, an earlier process)."""
        with self._lock:
            seen = self._validated
        if self._catalog_path is None or not self._catalog_path.is_file():
            return None if seen is None else max(0.0, now - seen)
        try:
            with Catalog(self._catalog_path) as book:
                records = book.generations(store_key(self.store.location), self.run_id)
        except (OSError, CheckpointError) as exc:
            logger.debug("metrics: could not read the catalog %s: %s", self._catalog_path, exc)
            records = []
        validated = [r.validated_at for r in records if r.validated_at is not None]
        validated += [] if seen is None else [seen]
        return max(0.0, now - max(validated)) if validated else None

    # -- serving ---------------------------------------------------------------------

    def serve(self, port: int, addr: str = "127.0.0.1") -> None:
        """Serve the registry at ``http://addr:port/metrics`` on a daemon thread
        (``port=0``: any free port; :attr:`port` says which)."""
        pc = import_prometheus("metrics_port")
        try:
            started = pc.start_http_server(port, addr, registry=self.registry)
        except OSError as exc:
            raise UsageError(
                f"metrics_port={port}, metrics_addr={addr!r}: cannot listen there "
                f"({exc.strerror or exc}); give a free port, or leave metrics_port out "
                "and mount mgr.metrics_registry in your own server"
            ) from exc
        self._server = started[0] if isinstance(started, tuple) else None
        self.port = self._server.server_port if self._server is not None else port

    def close(self) -> None:
        """Stop serving (the registry stays readable)."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()


class _ScrapeTime:
    """The values computed when scraped (a custom collector: one yields nothing for
    what cannot be known, instead of a stale or made-up number)."""

    def __init__(self, metrics: ManagerMetrics, pc: ModuleType) -> None:
        self.metrics = metrics
        self.core = importlib.import_module("prometheus_client.core")

    def describe(self) -> list[Any]:
        return []  # names are not known to clash: skip the registration-time collect

    def collect(self) -> Iterator[Any]:
        m, now, run = self.metrics, time.time(), [self.metrics.run_id]
        for name, doc, value in (
            (
                "ckptvault_last_good_checkpoint_age_seconds",
                "Seconds since the last generation was published (since start without one).",
                m.last_good_age(now),
            ),
            (
                "ckptvault_checkpoint_interval_seconds",
                "Median interval between recent publishes: the cadence.",
                m.cadence(),
            ),
            (
                "ckptvault_replication_lag_seconds",
                "How long the oldest generation not yet copied to the replica tier has "
                "waited; 0 when caught up.",
                m.replication_lag(),
            ),
            (
                "ckptvault_memory_last_save_age_seconds",
                "Seconds since the last save into the memory tier (since start without one).",
                m.memory_save_age(now),
            ),
            (
                "ckptvault_last_validated_checkpoint_age_seconds",
                "Seconds since the newest successful validation the catalog recorded.",
                m.last_validated_age(now),
            ),
        ):
            if value is not None:
                family = self.core.GaugeMetricFamily(name, doc, labels=["run_id"])
                family.add_metric(run, value)
                yield family
        yield from self._storage(run)

    def _storage(self, run: list[str]) -> Iterator[Any]:
        core = self.core
        used = core.GaugeMetricFamily(
            "ckptvault_storage_used_bytes",
            "Bytes of the generations held in each tier (marked ones included).",
            labels=["run_id", "tier"],
        )
        count = core.GaugeMetricFamily(
            "ckptvault_generations",
            "Generations in each tier that restore would consider (not marked).",
            labels=["run_id", "tier"],
        )
        ratio = core.GaugeMetricFamily(
            "ckptvault_storage_filesystem_used_ratio",
            "Used fraction of the filesystem under a POSIX tier (as df counts it).",
            labels=["run_id", "tier"],
        )
        for tier in ("local", "replica"):
            listed = self.metrics.usage(tier)
            if listed is None:
                continue
            used.add_metric([*run, tier], listed.used_bytes)
            count.add_metric([*run, tier], len(listed.live))
            if listed.filesystem is not None:
                ratio.add_metric([*run, tier], listed.filesystem.used_fraction)
        yield from (used, count, ratio)


def subscribe_metrics(
    events: Any,
    run_id: str,
    store: Store,
    *,
    enabled: bool | None,
    port: int | None,
    addr: str | None,
    is_coordinator: bool,
    replicator: Any = None,
    catalog_path: Path | None = None,
) -> ManagerMetrics | None:
    """The metrics the manager's options ask for, subscribed to ``events``; None when
    off (``enabled=False``; ``None``, the default: on when prometheus-client is
    installed, unless a port asks for it) or on a rank other than the coordinator.
    ``UsageError`` for a port with metrics off, or when serving was asked for and
    prometheus-client is missing or the port is taken."""
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535
    ):
        raise UsageError(f"metrics_port={port!r}: give a TCP port number (0: any free port)")
    if enabled is False:
        if port is not None:
            raise UsageError("metrics_port= serves the metrics: drop it, or metrics=False")
        return None
    if addr is not None and port is None:
        raise UsageError("metrics_addr= is where metrics_port listens: give metrics_port too")
    if enabled is None and port is None:
        try:
            import prometheus_client  # noqa: F401
        except ImportError:  # not asked for explicitly: quietly off
            return None
    if not is_coordinator:
        return None
    metrics = ManagerMetrics(
        run_id,
        store,
        replica=replicator.target if replicator is not None else None,
        replication_lag=(lambda: replicator.status().lag_seconds) if replicator else None,
        catalog_path=catalog_path,
    )
    events.subscribe(metrics)
    if port is not None:
        metrics.serve(port, addr or "127.0.0.1")
    return metrics
