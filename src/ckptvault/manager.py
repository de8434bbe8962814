"""``CheckpointManager``: the front door. It wires the parts and forwards calls.

Saving goes through the :class:`~ckptvault.saving.scheduler.SaveScheduler` to the
:class:`~ckptvault.saving.generation_writer.GenerationWriter`; restoring through
the :class:`~ckptvault.restoring.restorer.Restorer`. Both act in one
:class:`~ckptvault.run_context.RunContext` (store, run id, trust context,
coordinator, event bus). The manager touches no bytes, manifest fields or trust
details; a new feature is a new part or an event subscriber.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Mapping, MutableMapping
from datetime import datetime, timezone
from types import TracebackType
from typing import TYPE_CHECKING, Any

from ckptvault.assembly import ManagerOptions, assemble
from ckptvault.config import validate_step
from ckptvault.distributed.messages import any_rank
from ckptvault.errors import UsageError
from ckptvault.memory.writer import TieredWriter
from ckptvault.observe.progress_reporter import ProgressReporter
from ckptvault.restoring.lineage import LINEAGE
from ckptvault.restoring.restorer import RestoreInfo
from ckptvault.restoring.selector import SkippedGeneration
from ckptvault.restoring.validation import Factory, ValidationResult
from ckptvault.restoring.warm_start import WarmStartSource, warm_start
from ckptvault.retention import marks
from ckptvault.saving.handles import SaveHandle, SaveStats
from ckptvault.saving.metrics import validate_metrics
from ckptvault.saving.policy import SavePolicy
from ckptvault.state.capture import CapturedState, capture_state
from ckptvault.state.gradients import GradientWatch, with_gradients
from ckptvault.state.names import ApplyOptions, Rename
from ckptvault.state.param_names import parameter_names
from ckptvault.state.ranks import capture_ranked, unwrap_entries
from ckptvault.storage import StoreLocation
from ckptvault.storage.listing import GenerationInfo, list_generation_infos
from ckptvault.storage.s3.options import S3Options
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.signing import PublicKeyLike

if TYPE_CHECKING:
    from typing_extensions import Unpack  # typing.Unpack from Python 3.11

__all__ = ["CheckpointManager", "RestoreInfo", "SkippedGeneration"]

logger = logging.getLogger("ckptvault")


class CheckpointManager:
    """Saves and restores the training state of one run in one store.

    Args:
        directory: the store: a local path, ``file://``, ``s3://bucket/prefix`` or
            ``az://container/prefix`` URL.
        run_id: this run's identity, recorded in every manifest; restore skips
            generations of other runs. Required with any trust option; otherwise it
            defaults to the store directory's name.
        contract: what the numbers mean (config, dataset identity, ...): plain
            values, dataclasses or paths. Restore raises ``ContractMismatch`` when it
            differs from the stored one. ``None`` records nothing and checks nothing.
        signing_key: an Ed25519 private key (object or PEM path); every manifest is
            signed with it (``manifest.sig``).
        trusted_keys: Ed25519 public keys (objects or PEM paths); restore refuses
            generations not signed by one of them. Turns on the rollback floor.
        keystore: a key store (or the directory of a ``LocalKeyStore``, or a
            ``kms://`` URL for AWS KMS) holding the run's key-encryption key; turns on
            encryption of every tensor file.
        ledger: where the rollback floor is kept (outside the store); default a
            per-user state directory. Giving it, or ``trusted_keys``, turns on the floor.
        audit_log: the hash-chained audit log (default beside the ledger); written
            whenever any trust feature is on.
        catalog: the SQLite catalog of generations, save and restore timings and
            failures (default beside the ledger; ``False``: off). See ``ckptvault catalog``.
        catalog_keep_days: rows of saves, restores, validations and attempts older than
            this many days are pruned from the catalog when the manager first writes it
            (default 90; ``None``: never). ``ckptvault catalog --prune-older-than DAYS``.
        max_fallback: how many newer generations that fail verification restore may
            skip before it raises ``RollbackError`` (``None``: any; 2 is recommended).
        async_save: make ``save`` asynchronous by default (copy, return, write in the
            background).
        async_mode: where asynchronous saves are written: ``"thread"`` (default: a
            background thread of this process) or ``"process"`` (a long-lived writer
            process, staged through shared memory under ``/dev/shm``; this process's
            interpreter stays free for training; in a job of several ranks the
            writers save together in a gloo group of their own). ``"process"``
            writes to file-system stores and takes Shard/Replicate DTensors; it
            refuses S3 and a memory tier with a ``UsageError``.
        max_in_flight: background saves allowed at once (each holds one staged copy).
        if_busy: when ``max_in_flight`` saves are running, ``"wait"`` for the oldest,
            or ``"skip"`` the new save with a warning (counted in ``stats``).
        threads: worker threads for writing and verifying (default: up to 8).
        chunk_size: bytes per digest chunk in the manifest (default 4 MiB).
        segment_size: plaintext bytes per encrypted segment (default 1 MiB).
        coordinator: the rank/world seam (default: the torch.distributed job when a
            process group of several ranks is initialized, else this process alone).
        collective_timeout_s: how long a rank waits for the others in a collective
            save or restore before it raises ``CollectiveError`` (default 600).
        on_replica_mismatch: many ranks: when replicated tensors differ between ranks
            at save time, ``"warn"`` (default; log, audit entry, ``stats``), ``"raise"``
            (publish nothing) or ``"ignore"`` (do not hash them).
        s3_endpoint_url, s3_part_size, s3_max_concurrency, object_lock_days: options of
            an ``s3://bucket/prefix`` store (:class:`~ckptvault.storage.S3Options`);
            ``object_lock_days`` is a version-level immutability policy on an
            ``az://container/prefix`` store, whose account comes from the environment
            (:mod:`ckptvault.storage.azure.options`).
        replicate_to: a second, durable tier (path or URL): every published generation
            is copied there in the background, and restore falls back to it.
        retention: a :class:`~ckptvault.Retention` policy, applied after every publish
            (generations it drops are marked, then deleted after its ``delete_delay``);
            with ``replicate_to`` and no ``replica_retention`` it applies to both tiers.
            A generation is never deleted locally before its copy reached the replica.
        replica_retention: the replica tier's own policy (needs ``replicate_to``),
            applied there after each copy; ``retention`` then applies locally only.
        save_on_signal: signals that announce preemption, e.g. ``(signal.SIGTERM,)``:
            the next ``save()`` (or a check of ``preempted``) takes a final synchronous
            save and raises :class:`~ckptvault.Preempted` (exit code 75: restart).
        preemption_deadline_s: seconds from the signal to the end of that final save
            (default 120); a save the deadline cuts short is not published.
        metrics: Prometheus metrics of this manager's saves, restores, failures, storage
            and replication (:mod:`ckptvault.observe.prometheus`) in a registry of its
            own, ``mgr.metrics_registry``; default on when prometheus-client is installed
            (``pip install 'ckptvault[metrics]'``), ``False``: off.
        metrics_port, metrics_addr: serve them at ``http://ADDR:PORT/metrics`` (default
            address 127.0.0.1; port 0: any free one, ``mgr.metrics.port`` says which).
        validate_every, validate_with: validate one published generation in K on a
            background thread: load it into objects ``validate_with()`` builds (a
            factory, or ``"module:function"``) and run their check (see ``validate``).
        memory_tier: a :class:`~ckptvault.MemoryTier`: every save goes to a node-local
            directory on tmpfs, every ``durable_every``-th also to this store (a
            verified copy of the same generation); restore tries memory first
            (``RestoreInfo.source``: "memory", "peer" or "store"); on several nodes
            each keeps copies of others' (``peers``; :mod:`ckptvault.memory`).
        save_policy: when to save, for :meth:`should_save`: ``cv.Every(steps=N)``,
            ``cv.Every(seconds=S)``, ``cv.Planned(mtbf_hours=H, nodes=N)`` (Daly's
            interval from the save cost measured in this run) or ``cv.Any(...)`` of
            them (:mod:`ckptvault.saving.policy`).
    """

    def __init__(self, directory: StoreLocation, **options: Unpack[ManagerOptions]) -> None:
        parts = assemble(directory, options)
        self.store, self.config, self.trust = parts.store, parts.config, parts.trust
        self.run_id = parts.config.run_id
        self.coordinator, self.events = parts.coordinator, parts.events
        self.replicator, self.retention = parts.replicator, parts.retention
        self._writer, self._scheduler = parts.writer, parts.scheduler
        self._restorer = parts.restorer
        self._preemption = parts.preemption
        self._decider = parts.decider  # None without save_policy=
        self.metrics = parts.metrics  # None when off; .registry, .port
        self.metrics_registry = parts.metrics.registry if parts.metrics is not None else None
        self._validator, self._sampled_validation = parts.validator, parts.sampled_validation
        self._gradients = GradientWatch()
        self._progress = ProgressReporter.for_manager(
            self.run_id, self.coordinator, options.get("ledger"), self.metrics_registry
        )
        self._writer.watch(self._progress)  # a save that writes is progress too
        self._closed = False

    @property
    def stats(self) -> SaveStats:
        """Counters of saves started, completed, failed and skipped, bytes, timings."""
        return self._scheduler.stats

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        blocking: bool | None = None,
        metrics: Mapping[str, float] | None = None,
        *,
        include_grads: bool = False,
        strict: bool = False,
        durable: bool = False,
    ) -> SaveHandle:
        """Save ``state`` as a new generation of ``step``; ``metrics`` (name -> finite
        number, e.g. ``{"val_loss": 0.3}``) are recorded in its manifest.

        With a memory tier, ``durable=True`` sends this save to the store too, whatever
        ``durable_every`` says (a preemption's final save always goes there); without
        one every save is durable.

        Synchronous (the default unless ``async_save=True``): the generation is durable
        when this returns. Asynchronous (``blocking=False``): returns as soon as the
        state is copied into staging buffers; writing and publishing happen in the
        background, and an error surfaces from the handle, the next ``save``,
        ``wait`` or ``close``. The first asynchronous save (unless ``prepare`` came
        first) raises ``HostMemoryError``, staging nothing, when ``max_in_flight``
        staged copies would not fit in this host's available memory.

        A save between ``backward()`` and ``optimizer.step()`` drops the accumulated
        gradients, so its resume is not exact: it is warned about (``strict=True``
        raises ``UsageError``); ``include_grads=True`` saves them and restore puts
        them back (:mod:`ckptvault.state.gradients`).
        """
        step = validate_step(step)
        recorded = validate_metrics(metrics)
        self._check_open()
        self._record_progress(step, collective=False)  # a save's collectives stay its own
        self._gradients.check(step, state, include_grads, strict)
        if include_grads:
            state = with_gradients(state)
        if self.preempted:
            raise self._final_save(step, state, recorded)
        self._scheduler.raise_background_error()
        blocking = not self.config.async_save if blocking is None else blocking
        if durable and isinstance(self._writer, TieredWriter):
            self._writer.make_durable(step)
        handle = self._submit(step, state, blocking, time.perf_counter(), recorded)
        if self._decider is not None and not handle.skipped:  # a skipped save is still due
            self._decider.saved(step, handle.stall_seconds)
        return handle

    def _submit(
        self,
        step: int,
        state: Mapping[str, Any],
        blocking: bool,
        started: float,
        metrics: dict[str, int | float] | None,
    ) -> SaveHandle:
        self.trust.ensure_key_usable(self.run_id)  # KeyDestroyedError after crypto-erase
        captured = self._capture(state)  # unsupported values fail here, before any I/O
        if self.coordinator.is_coordinator:  # one writer per job: the coordinator
            self.store.acquire_writer()
        return self._scheduler.submit(step, captured, blocking, started, metrics)

    def heartbeat(self, step: int, *, step_seconds: float | None = None) -> None:
        """Tell a watchdog this rank is making progress at ``step`` (``save()`` and
        ``should_save()`` do it too); call it on every rank alike, as ``save()``.

        Cheap: a clock read, and at most twice a second a tiny file that ``ckptvault
        supervise --hang-timeout`` watches (beside the ledger when not supervised).
        The 10th, 25th, 50th and every 100th call (of this and ``should_save``)
        gathers each rank's recent step time on rank 0 for the metrics
        (``ckptvault_rank_step_seconds``, ``ckptvault_straggler``).
        ``step_seconds``: this rank's own measure of its step (e.g. compute time up to
        the gradient all-reduce), instead of the wall time between heartbeats
        (:mod:`ckptvault.observe.stragglers` says when that matters).
        """
        self._check_open()
        self._record_progress(validate_step(step), step_seconds=step_seconds)

    @property
    def save_policy(self) -> SavePolicy | None:
        """The ``save_policy=`` that :meth:`should_save` follows (None: none given)."""
        return None if self._decider is None else self._decider.policy

    def should_save(self, step: int) -> bool:
        """Whether to save ``step``, by ``save_policy=`` (:mod:`ckptvault.saving.policy`),
        or because a ``save_on_signal`` signal arrived (the next ``save()`` is the final
        one). Every rank gets the same answer: call it on every rank, for the same
        steps (time rules are decided by rank 0 and broadcast, one tiny collective;
        step rules need none). ``UsageError`` without a ``save_policy``."""
        step = validate_step(step)
        self._check_open()
        if self._decider is None:
            raise UsageError(
                f"should_save({step}) needs a save policy: create the CheckpointManager "
                "with save_policy=cv.Every(steps=N), cv.Every(seconds=S), "
                "cv.Planned(mtbf_hours=H, nodes=N) or cv.Any(...) of them"
            )
        # -- progress (the watchdog's heartbeat): kept apart from the decision --
        self._record_progress(step)
        # -- the decision --
        if self.preempted:  # the ranks agree; the final save must not wait for the policy
            return True
        return self._decider.should_save(step)

    def _record_progress(
        self, step: int, *, collective: bool = True, step_seconds: float | None = None
    ) -> None:
        """Progress at ``step`` (heartbeat, should_save, save); ``collective``: this
        call may gather the ranks' step times (False for a save)."""
        self._progress.beat(step, collective=collective, step_seconds=step_seconds)

    def prepare(self, state: Mapping[str, Any], wait: bool = False) -> None:
        """Get asynchronous saves' staging buffers ready for ``state`` (what a save
        of it would copy) on a background thread; returns at once.

        Without it the first async save allocates its buffers and faults them in
        inside the stall; after it, even the first stall is one memory copy. Call it
        once the state has the layout it will be saved with (after the first
        optimizer step, which creates Adam's moments; again if the layout changes);
        a save that comes before it finishes waits for it. Costs the staging memory
        ``max_in_flight`` saves would hold anyway. ``wait=True`` returns only once the
        buffers are ready. Raises ``HostMemoryError`` (saying what is needed and what
        is available; nothing allocated) when they would not fit in this host's
        available memory (``/dev/shm`` too with ``async_mode="process"``).
        """
        self._check_open()
        self._scheduler.prepare(self._capture(state).tensors, wait)

    @property
    def preempted(self) -> bool:
        """Whether a ``save_on_signal`` signal arrived (on any rank: the ranks agree,
        with one small collective per check). The next ``save()`` is the final one."""
        if self._preemption is None:
            return False
        requested = self._preemption.requested
        if self.coordinator.world_size > 1 and any_rank(
            self.coordinator, requested, "whether a preemption signal arrived"
        ):
            if not requested:
                self._preemption.requested_elsewhere()
            return True
        return requested

    def _final_save(
        self, step: int, state: Mapping[str, Any], metrics: dict[str, int | float] | None
    ) -> BaseException:
        assert self._preemption is not None
        try:
            self._scheduler.raise_background_error()
        except Exception as exc:  # already lost: say so, but still save what is here now
            logger.error("a background save failed before the preemption: %s", exc)
        if isinstance(self._writer, TieredWriter):  # the node may not come back
            self._writer.make_durable(step)
        return self._preemption.final_save(
            step,
            self._scheduler.drain,
            lambda: self._submit(step, state, True, time.perf_counter(), metrics),
        )

    def wait(self) -> None:
        """Wait for every save in flight; raise the first background error not yet raised."""
        self._scheduler.drain()
        self._scheduler.raise_background_error()

    def restore(
        self,
        state: MutableMapping[str, Any],
        step: int | None = None,
        strict: bool = True,
        allow_contract_change: bool = False,
        allow_rollback_to: int | None = None,
        *,
        rename: Rename = None,
        strict_dtypes: bool = False,
        strict_env: bool = False,
        in_place: bool = False,
    ) -> RestoreInfo | None:
        """Restore the newest generation (of ``step``, when given) that verifies.

        Returns ``None`` when the store holds no generation at all. Raises
        ``NoValidCheckpoint`` when generations exist but none verifies (``RollbackError``
        when any was refused for the rollback floor), ``ContractMismatch`` or
        ``StateMismatchError`` when the verified generation does not fit the live
        objects, ``KeyDestroyedError`` after crypto-erase; in every raising case
        ``state`` is untouched.

        With a ledger (``ledger`` or ``trusted_keys``), ``step=STEP`` below a newer
        generation that restore would trust (one above STEP that passes every check
        needing no tensor byte: signature, run, files, headers, the manifest's MAC) is a
        rollback: ``RollbackError``, nothing loaded. Newer generations that fail those
        checks, or that the ledger saw published and the store no longer holds, are
        skipped (``RestoreInfo.skipped``) and counted by ``max_fallback``.
        ``allow_rollback_to=STEP`` restores the generation of ``STEP`` even below the
        floor or a newer generation; the floor is lowered to it and every newer
        generation made before the rollback is abandoned; it is logged at WARNING,
        audited (``rollback_allowed``) and shown in ``RestoreInfo.rolled_back_from``.
        More than ``max_fallback`` failed newer generations: ``RollbackError``.

        ``strict=False`` loads what matches and lists the rest in the returned
        ``RestoreInfo`` (``missing``, ``unexpected``, ``mismatched``); a module none of
        whose keys match is still an error. Module keys match by their plain names
        (``torch.compile``'s ``_orig_mod.`` ignored); ``rename={"old.": "new."}`` (or a
        callable) maps checkpoint names to live ones. A tensor saved in another dtype
        is cast to the live one, as ``load_state_dict`` does, and listed in
        ``RestoreInfo.casts``; ``strict_dtypes=True`` refuses it instead. Software
        versions or CUDA devices that differ from the saved ones are listed in
        ``RestoreInfo.environment`` with a warning; ``strict_env=True`` raises
        ``EnvironmentMismatch`` instead.

        ``in_place=True`` (one process) reads tensors straight into the live ones where
        dtype, shape and layout match, so the restore needs no second copy of the
        state: the generation is verified whole first, then read again into them. The
        one exception to "state untouched on failure": a file that changes between the
        two passes raises ``IntegrityError`` with live tensors partly overwritten
        (restore again); see :mod:`ckptvault.io.in_place`.
        """
        self._check_open()
        options = ApplyOptions(
            rename=rename, strict_dtypes=strict_dtypes, strict_env=strict_env, in_place=in_place
        )
        # A memory tier on several nodes: each node first fetches what its peers hold.
        fetched = self._writer.before_restore() if isinstance(self._writer, TieredWriter) else set()
        info = self._restorer.restore(
            state, step, strict, allow_contract_change, allow_rollback_to, options
        )
        if info is not None and info.source == "memory" and info.generation_id in fetched:
            info = dataclasses.replace(info, source="peer")
        if info is not None and info.source != "store" and isinstance(self._writer, TieredWriter):
            # Its progress is in memory alone, and durable_every counts this manager's
            # saves: a job restarting from memory must not stay there for ever.
            self._writer.make_next_durable()
        if info is not None:
            self._writer.parent = info.generation_id
            if info.lineage is not None:  # a warm-started run keeps saying where it began
                self._writer.contract[LINEAGE] = info.lineage.as_contract()
        self._gradients.observe(state)  # from here on, saves mid-accumulation are seen
        return info

    def warm_start(
        self,
        state: MutableMapping[str, Any],
        source: str | os.PathLike[str],
        *,
        source_run_id: str | None = None,
        step: int | None = None,
        trusted_keys: Iterable[PublicKeyLike] | PublicKeyLike | None = None,
        keystore: str | KeyStore | None = None,
        source_s3: S3Options | None = None,
        strict: bool = True,
        rename: Rename = None,
        strict_dtypes: bool = False,
    ) -> RestoreInfo:
        """Start this run from run ``source_run_id``'s newest verified generation (of
        ``step``) in ``source``: a fine-tune from a pretraining run.

        The source is read only, under its own trust policy (``trusted_keys``,
        ``keystore``; ``source_s3``: options of an ``s3://`` source), never written
        to. ``strict``, ``rename`` and ``strict_dtypes``
        work as in :meth:`restore`. The source's run, step and generation are recorded
        as the lineage of every generation this run saves (``RestoreInfo.lineage``).
        Only for a run with no generation yet: after a crash, ``restore()`` resumes
        the run itself (``info = mgr.restore(state) or mgr.warm_start(state, ...)``).

        ``source`` may also be Hugging Face weights: a ``save_pretrained`` directory
        (``model.safetensors``, or shards with ``model.safetensors.index.json``) or one
        ``.safetensors`` file, loaded into the one module in ``state`` (its names
        matched to the module's state dict, or mapped by ``rename``), checked against
        hostile input before anything is applied, each file's BLAKE3 digest recorded
        in the lineage (:mod:`ckptvault.restoring.hf_weights`). No ``source_run_id``.
        """
        self._check_open()
        if self.coordinator.world_size > 1:
            raise UsageError(
                "warm_start runs in one process; on many ranks, export the source's weights "
                "and load them, or restore with a manager of the source run"
            )
        if self.generations(include_marked=True):
            raise UsageError(
                f"run {self.run_id} already has generations in {self.store.location}: "
                "warm_start only starts a new run; resume this one with restore()"
            )
        options = ApplyOptions(rename=rename, strict_dtypes=strict_dtypes)
        found = WarmStartSource(source, source_run_id, step, trusted_keys, keystore, source_s3)
        info = warm_start(state, found, self.config.threads, strict, options)
        assert info.lineage is not None
        self._writer.contract[LINEAGE] = info.lineage.as_contract()
        self._gradients.observe(state)
        return info

    def validate(self, factory: Factory, step: int | None = None) -> ValidationResult:
        """Load the newest generation (of ``step``) into objects ``factory()`` builds
        and run their check (:mod:`ckptvault.restoring.validation`); the catalog
        records the outcome, and retention keeps the newest validated generation.
        Never touches the live state, the rollback floor or the next save's parent."""
        self._check_open()
        assert self._validator is not None
        return self._validator.validate(None if step is None else validate_step(step), factory)

    def generations(self, include_marked: bool = False) -> list[GenerationInfo]:
        """Published generations, newest first (not verified; see ``ckptvault verify``);
        those marked for deletion only with ``include_marked``."""
        return list_generation_infos(self.store, include_marked)

    def pin(self, step: int) -> GenerationInfo:
        """Keep every generation of ``step`` from retention (a mark on one goes too; every
        one, since a directory planted under the step could otherwise take the pin);
        returns the newest."""
        ref = marks.pin(self.store, validate_step(step), datetime.now(timezone.utc))
        return next(g for g in self.generations(True) if g.generation_id == ref.generation_id)

    def unpin(self, step: int) -> None:
        """Let retention decide about ``step``'s generations again."""
        marks.unpin(self.store, validate_step(step))

    def close(self) -> None:
        """Wait for saves in flight and release the store's writer lock.

        Raises the first background save error not raised before (after releasing)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._scheduler.close()
        finally:
            if self._preemption is not None:
                self._preemption.close()
            if self.metrics is not None:
                self.metrics.close()  # stops serving; the registry stays readable
            if self._sampled_validation is not None:
                self._sampled_validation.close()
            if self.replicator is not None:
                self.replicator.close()  # waits for copies in flight
            self.store.release_writer()
            self._writer.close()

    def _capture(self, state: Mapping[str, Any]) -> CapturedState:
        if self.coordinator.world_size > 1:  # each rank's own entries apart
            return capture_ranked(state, self.coordinator.rank)
        # One process: PerRank entries are plain; parameter names as restore finds them.
        return capture_state(unwrap_entries(state), parameter_names(state))

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"this CheckpointManager for {self.store.location} is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.close()
        except Exception as background:
            if exc is None:
                raise
            # Do not mask the exception that is already propagating.
            logger.error("a background save failed while %r was propagating: %s", exc, background)

    def __repr__(self) -> str:
        return f"CheckpointManager({self.store.location!r}, run_id={self.run_id!r})"
