"""Building a manager's parts from its options, in one place.

:class:`ManagerOptions` lists every keyword :class:`~ckptvault.CheckpointManager`
accepts (documented on the class); :func:`assemble` validates them and wires the
parts: the store, the plain config, the trust context and its subscribers, the
coordinator, the event bus, replication and retention, the generation writer, the
save scheduler and the restorer. The manager keeps the result and only forwards
calls, so adding an option or a part changes this file, not the front door.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from ckptvault.config import ManagerConfig, resolve_run_id
from ckptvault.coordinator import Coordinator, SingleProcess
from ckptvault.distributed.messages import any_rank
from ckptvault.distributed.save import CollectiveSave
from ckptvault.errors import UsageError
from ckptvault.events import EventBus
from ckptvault.io.writer import default_threads
from ckptvault.memory.attach import attach_memory_tier
from ckptvault.memory.tier import MemoryTier
from ckptvault.memory.writer import TieredWriter
from ckptvault.observe.catalog import validated_generations
from ckptvault.observe.catalog_prune import DEFAULT_KEEP_DAYS
from ckptvault.observe.catalog_recorder import (
    CatalogOption,
    resolve_catalog_path,
    subscribe_catalog,
)
from ckptvault.observe.prometheus import ManagerMetrics, subscribe_metrics
from ckptvault.observe.save_costs import measured_save_costs
from ckptvault.replication.replicator import Replicator
from ckptvault.replication.tiers import attach_retention
from ckptvault.restoring.restorer import Restorer
from ckptvault.restoring.validation import Factory, SampledValidation, Validator
from ckptvault.retention.keeper import RetentionKeeper
from ckptvault.retention.policy import Retention
from ckptvault.run_context import RunContext
from ckptvault.saving.decider import SaveDecider
from ckptvault.saving.generation_writer import GenerationWriter, WriteSettings
from ckptvault.saving.policy import SavePolicy
from ckptvault.saving.preemption import DEFAULT_DEADLINE_S, PreemptionWatch
from ckptvault.saving.scheduler import SaveScheduler
from ckptvault.saving.writer_process import WriterProcess
from ckptvault.state.contract import build_contract, code_revision, encode_contract_fields
from ckptvault.storage import RemoteOptions, StoreLocation, open_store
from ckptvault.storage.base import Store
from ckptvault.trust.context import TrustContext
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.signing import PrivateKeyLike, PublicKeyLike

TRUST_OPTIONS = ("signing_key", "trusted_keys", "keystore", "ledger", "audit_log")


class ManagerOptions(TypedDict, total=False):
    run_id: str | None
    contract: Mapping[str, Any] | None
    signing_key: PrivateKeyLike | None
    trusted_keys: Iterable[PublicKeyLike] | PublicKeyLike | None
    keystore: str | os.PathLike[str] | KeyStore | None
    ledger: str | os.PathLike[str] | None
    audit_log: str | os.PathLike[str] | None
    catalog: CatalogOption
    catalog_keep_days: float | None
    max_fallback: int | None
    async_save: bool
    async_mode: str
    max_in_flight: int
    if_busy: str
    threads: int | None
    chunk_size: int
    segment_size: int
    coordinator: Coordinator | None
    collective_timeout_s: float
    on_replica_mismatch: str
    s3_endpoint_url: str | None
    s3_part_size: int | None
    s3_max_concurrency: int | None
    object_lock_days: int | None
    replicate_to: StoreLocation | None
    retention: Retention | None
    replica_retention: Retention | None
    save_on_signal: Iterable[int] | None
    preemption_deadline_s: float
    metrics: bool | None
    metrics_port: int | None
    metrics_addr: str | None
    validate_every: int | None
    validate_with: Factory | str | None
    memory_tier: MemoryTier | None
    save_policy: SavePolicy | None


@dataclass
class ManagerParts:
    store: Store
    config: ManagerConfig
    trust: TrustContext
    coordinator: Coordinator
    events: EventBus
    replicator: Replicator | None
    retention: RetentionKeeper | None
    writer: GenerationWriter | TieredWriter
    scheduler: SaveScheduler
    restorer: Restorer
    preemption: PreemptionWatch | None = None
    validator: Validator | None = None
    sampled_validation: SampledValidation | None = None
    metrics: ManagerMetrics | None = None
    decider: SaveDecider | None = None


def assemble(directory: StoreLocation, options: ManagerOptions) -> ManagerParts:
    """Validate ``options`` and build every part; nothing is written yet."""
    store, remote = _open_checked_store(directory, options)
    replicate_to = options.get("replicate_to")
    trust_options: dict[str, Any] = {name: options.get(name) for name in TRUST_OPTIONS}
    config = _config(options, store.location, trust_options)
    encode_contract_fields(config.contract or {})  # fail now, not at the first save
    trust = TrustContext.configure(**trust_options)
    trust.check_outside(store)
    coordinator = options.get("coordinator") or _default_coordinator(options)
    events = EventBus(trust.subscribers())
    recorder = subscribe_catalog(
        events,
        store,
        coordinator,
        options.get("catalog"),
        options.get("ledger"),
        options.get("catalog_keep_days", DEFAULT_KEEP_DAYS),
    )
    replicator = Replicator.attach(
        store, replicate_to, events, trust, config.run_id, remote.for_location(replicate_to)
    )
    run = RunContext(store, config.run_id, trust, coordinator, events)
    tiers = [replicator.target] if replicator else []
    retention = attach_retention(  # None without a local policy
        run, options.get("retention"), options.get("replica_retention"), replicator
    )
    _spare_validated(retention, options, config.run_id)
    writer = GenerationWriter(
        run,
        build_contract(config.contract, code_revision()),
        WriteSettings(
            config.threads, config.chunk_size, config.segment_size, _replica_policy(options)
        ),
        collective=CollectiveSave,
    )
    saver, memory_tiers = _memory_tier(options, run, writer)
    scheduler = SaveScheduler(
        saver.write,
        saver.announce,
        config.max_in_flight,
        config.if_busy,
        saver.announce_failure,
        _writer_process(config, saver, options.get("collective_timeout_s", 600.0)),
        _any_rank(coordinator, "whether a rank's host has no memory for its staging slots"),
    )
    validator = Validator(run, config.threads)
    restorer = Restorer(
        run,
        config.threads,
        config.contract,
        config.max_fallback,
        remote_tiers=tiers,
        on_remote_restore=replicator.fetch if replicator else None,
        memory_tiers=memory_tiers,
    )
    decider = _save_decider(options, run, recorder.path if recorder else None)
    # Serves last but one (before the signal handlers): a taken port fails the manager.
    metrics = _metrics(options, run, replicator, recorder.path if recorder else None)
    if metrics is not None and memory_tiers:
        metrics.memory_location = memory_tiers[0].location
    return ManagerParts(
        store,
        config,
        trust,
        coordinator,
        events,
        replicator,
        retention,
        saver,
        scheduler,
        restorer,
        _preemption(options),
        validator,
        _sampled_validation(options, validator, events, coordinator),
        metrics=metrics,
        decider=decider,
    )


def _open_checked_store(
    directory: StoreLocation, options: ManagerOptions
) -> tuple[Store, RemoteOptions]:
    """The manager's store, after the options every part relies on are checked."""
    unknown = sorted(set(options) - set(ManagerOptions.__annotations__))
    if unknown:
        raise UsageError(f"CheckpointManager got unknown options: {', '.join(unknown)}")
    remote = _remote_options(options)  # for every remote tier: the store and its replica
    remote.check_used_by(directory, options.get("replicate_to"))
    return open_store(directory, **remote.for_location(directory)), remote


def _spare_validated(
    retention: RetentionKeeper | None, options: ManagerOptions, run_id: str
) -> None:
    """Retention never prunes the newest validated generation: it learns which ones
    were validated from the catalog."""
    if retention is not None:
        path = resolve_catalog_path(options.get("catalog"), options.get("ledger"))
        retention.collector.validated = lambda: validated_generations(path, run_id)


def _memory_tier(
    options: ManagerOptions, run: RunContext, writer: GenerationWriter
) -> tuple[GenerationWriter | TieredWriter, list[Store]]:
    """The writer saves go through, and the memory tier restore reads first (if any)."""
    tier = options.get("memory_tier")
    if tier is None:
        return writer, []
    tiered, store = attach_memory_tier(run, writer, tier)
    return tiered, [store]


def _writer_process(
    config: ManagerConfig, saver: GenerationWriter | TieredWriter, timeout: float
) -> WriterProcess | None:
    """The writer process of ``async_mode="process"`` (started on first use)."""
    if config.async_mode != "process":
        return None
    if isinstance(saver, TieredWriter):
        raise UsageError(
            "async_mode='process' does not yet write a memory tier; use async_mode='thread' "
            "with memory_tier=..."
        )
    return WriterProcess(saver, timeout)


def _metrics(
    options: ManagerOptions,
    run: RunContext,
    replicator: Replicator | None,
    catalog_path: Path | None,
) -> ManagerMetrics | None:
    """The Prometheus subscriber (and its HTTP endpoint) of ``metrics=...``."""
    return subscribe_metrics(
        run.events,
        run.run_id,
        run.store,
        enabled=options.get("metrics"),
        port=options.get("metrics_port"),
        addr=options.get("metrics_addr"),
        is_coordinator=run.coordinator.is_coordinator,
        replicator=replicator,
        catalog_path=catalog_path,
    )


def _sampled_validation(
    options: ManagerOptions, validator: Validator, events: EventBus, coordinator: Coordinator
) -> SampledValidation | None:
    """The background validation of one generation in ``validate_every``."""
    every, factory = options.get("validate_every"), options.get("validate_with")
    if every is None and factory is None:
        return None
    if every is None or factory is None:
        raise UsageError("validate_every=K and validate_with=factory go together")
    if not coordinator.is_coordinator:
        return None  # one rank validates for the job
    sampled = SampledValidation(validator, every, factory)
    events.subscribe(sampled)
    return sampled


def _save_decider(
    options: ManagerOptions, run: RunContext, catalog_path: Path | None
) -> SaveDecider | None:
    """``should_save``'s decider for ``save_policy=`` (rank 0 reads what this run's
    saves cost before a restart from the catalog: only its schedule uses it)."""
    policy = options.get("save_policy")
    if policy is None:
        return None
    costs = measured_save_costs(catalog_path, run.store.location, run.run_id)
    return SaveDecider(policy, run.coordinator, costs)


def _preemption(options: ManagerOptions) -> PreemptionWatch | None:
    """The signal watch of ``save_on_signal`` (installed last: nothing after it can
    fail and leave handlers behind)."""
    signals = options.get("save_on_signal")
    deadline = options.get("preemption_deadline_s", DEFAULT_DEADLINE_S)
    if signals is None:
        if "preemption_deadline_s" in options:
            raise UsageError("preemption_deadline_s needs save_on_signal=(signal.SIGTERM,)")
        return None
    return PreemptionWatch(signals, deadline)


def _replica_policy(options: ManagerOptions) -> str:
    from ckptvault.distributed.replicas import POLICIES

    policy = options.get("on_replica_mismatch", "warn")
    if policy not in POLICIES:
        raise UsageError(f"on_replica_mismatch={policy!r}: give one of {', '.join(POLICIES)}")
    return policy


def _default_coordinator(options: ManagerOptions) -> Coordinator:
    """A torch.distributed job's coordinator when a process group of several ranks
    is initialized, else this process alone."""
    from ckptvault.distributed.coordinator import DEFAULT_TIMEOUT_S, default_coordinator

    timeout = options.get("collective_timeout_s", DEFAULT_TIMEOUT_S)
    return default_coordinator(timeout) or SingleProcess()


def _remote_options(options: ManagerOptions) -> RemoteOptions:
    """The options of remote stores given (each backend takes its own)."""
    return RemoteOptions.from_keywords(
        s3_endpoint_url=options.get("s3_endpoint_url"),
        s3_part_size=options.get("s3_part_size"),
        s3_max_concurrency=options.get("s3_max_concurrency"),
        object_lock_days=options.get("object_lock_days"),
    )


def _config(options: ManagerOptions, location: str, trust_options: dict[str, Any]) -> ManagerConfig:
    """The plain settings, with their defaults; the run id is resolved against the store."""
    contract = options.get("contract")
    return ManagerConfig(
        run_id=resolve_run_id(options.get("run_id"), location, trust_options),
        contract=dict(contract) if contract is not None else None,
        async_save=options.get("async_save", False),
        async_mode=options.get("async_mode", "thread"),
        max_in_flight=options.get("max_in_flight", 1),
        if_busy=options.get("if_busy", "wait"),
        threads=options.get("threads") or default_threads(),
        chunk_size=options.get("chunk_size", ManagerConfig.chunk_size),
        segment_size=options.get("segment_size", ManagerConfig.segment_size),
        max_fallback=options.get("max_fallback"),
    )


def _any_rank(coordinator: Coordinator, what: str) -> Callable[[bool], bool] | None:
    """``any_rank`` over the job's coordinator (None for one process: nothing to
    agree on)."""
    if coordinator.world_size <= 1:
        return None
    return lambda mine: any_rank(coordinator, mine, what)
