"""Restore: choose a generation, verify all of it, then apply it in place.

The selector picks candidates newest first; :func:`load_verified` checks each one
completely (signature, run, floor, files, every digest, decryption) into private
buffers; the first that passes is matched against the live objects (contract,
keys, shapes) and only then applied, RNG last. A restore that raises leaves the
caller's state untouched; every outcome is told to the event subscribers, with the
seconds spent in discovery, verification, read and apply. While a candidate is read,
a reader lease on it keeps garbage collection from deleting it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptvault.distributed.restore import CollectiveLoader, optimizer_param_hints
from ckptvault.errors import (
    AuditError,
    CheckpointError,
    EnvironmentMismatch,
    NoValidCheckpoint,
    StateMismatchError,
)
from ckptvault.events import Refused, Restored, RollbackApplied
from ckptvault.io import in_place
from ckptvault.io.load import (
    LoadedGeneration,
    decode_for_rank,
    load_verified,
    prepare_load,
    saved_world_size,
)
from ckptvault.restoring.gc_pause import cyclic_gc_paused
from ckptvault.restoring.lineage import Lineage
from ckptvault.restoring.rollback import allowed_rollback, warn_rollback
from ckptvault.restoring.selector import CandidateSelector, Selection, SkippedGeneration
from ckptvault.restoring.tiers import merge_tiers
from ckptvault.run_context import RunContext
from ckptvault.state.apply import checked_plan
from ckptvault.state.contract import compare_contracts
from ckptvault.state.environment import environment_differences
from ckptvault.state.gradients import gradient_slots
from ckptvault.state.names import ApplyOptions
from ckptvault.state.ranks import capture_ranked, leave_per_rank_alone
from ckptvault.state.restore_plan import RestorePlan
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.storage.leases import reading_lease
from ckptvault.timing import StageClock
from ckptvault.trust.checks import TrustPolicy

logger = logging.getLogger("ckptvault")


@dataclass(frozen=True)
class RestoreInfo:
    """What ``restore`` applied, and every newer generation it rejected and why."""

    step: int
    generation_id: str
    path: str
    skipped: list[SkippedGeneration] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    # The key id whose signature was verified against ``trusted_keys``; "unverified"
    # when the generation carries a signature but no trusted keys were given (the key
    # id it claims is not reported: anyone can write a claim); None when unsigned.
    signer: str | None = None
    # Per-rank entries left as they were: saved by another world size, they mean
    # nothing here (``ckptvault.state.ranks``).
    reset: list[str] = field(default_factory=list)
    # What was applied: each entry loaded ("model (12 of 14 keys)", "optimizer", a
    # tensor's path), every tensor cast to the live dtype ("model.w: torch.bfloat16 ->
    # torch.float32"), every checkpoint name mapped by rename= ("model.a.w -> b.w").
    # With strict=False, ``missing``/``unexpected``/``mismatched`` list what was not.
    loaded: list[str] = field(default_factory=list)
    casts: list[str] = field(default_factory=list)
    renamed: list[str] = field(default_factory=list)
    # How the environment differs from the one the generation was saved in
    # ("torch: 2.12.0 (saved) -> 2.13.0 (now)"); warned about, refused by strict_env.
    environment: list[str] = field(default_factory=list)
    # The run this one started from (warm_start), as its manifests record it.
    lineage: Lineage | None = None
    # After restore(allow_rollback_to=STEP) with a ledger (on the coordinator): the
    # step the run was rolled back from (the previous floor, or the newest newer
    # generation that verified); None when nothing newer was gone back over.
    rolled_back_from: int | None = None
    # Where the bytes came from: "memory" (this node's memory tier), "peer" (a memory
    # generation this node fetched from another's) or "store" (the store, its tiers).
    source: str = "store"


def check_environment(contract: Any, where: str, options: ApplyOptions) -> list[str]:
    """The environment's differences from the saved one: a warning, or under
    ``strict_env`` an :class:`EnvironmentMismatch` (before anything is applied)."""
    differences = environment_differences(contract)
    if differences and options.strict_env:
        raise EnvironmentMismatch(
            f"{where} was saved in another environment: {'; '.join(differences)}. Restore "
            "with the same software and devices for an exact resume, or without "
            "strict_env=True to accept the difference.",
            differences,
        )
    if differences:
        logger.warning("%s was saved in another environment: %s", where, "; ".join(differences))
    return differences


def _read_in_place(
    state: MutableMapping[str, Any],
    loaded: LoadedGeneration,
    plan: RestorePlan,
    options: ApplyOptions,
    strict: bool,
    where: str,
) -> RestorePlan:
    """Pass 2 of an in-place restore (:mod:`ckptvault.io.in_place`): the big tensors
    read where ``plan`` (made with placeholders, every check passed) puts them, then
    the plan made again with the tensors read, to be applied."""
    pending = loaded.pending
    assert pending is not None
    try:
        destinations = pending.destinations(plan.targets)
    except OSError as exc:  # no memory for the tensors that cannot be read in place
        raise CheckpointError(f"restoring {where} in place: {exc}; nothing was applied") from exc
    in_place.read_in_place(pending, destinations)
    tensors = {**pending.small, **destinations.tensors}
    saved, _reset = decode_for_rank(loaded.ref, loaded.manifest, pending.tree, tensors, 0, 1)
    try:  # the same plan as before: it depends on shapes and types, not on values
        return checked_plan(state, saved, loaded.reset, options, strict, where)
    except CheckpointError as exc:
        raise StateMismatchError(
            f"restoring {where} in place: the state no longer matched it once its tensors "
            f"were read ({exc}); {len(destinations.live)} live tensors already hold its "
            "values, nothing else was applied: restore again"
        ) from exc


def _warn_fallback(ref: GenerationRef, skipped: list[SkippedGeneration]) -> None:
    """One loud line when restore did not take the newest generation."""
    if skipped:
        logger.warning(
            "restored step %d (generation %s) after skipping %d newer generation(s): %s "
            "(details in RestoreInfo.skipped and the audit log's restore entry)",
            ref.step,
            ref.generation_id,
            len(skipped),
            ", ".join(f"step {s.step} ({s.reason.split(':')[0]})" for s in skipped),
        )


class Restorer:
    def __init__(
        self,
        run: RunContext,
        threads: int,
        contract_fields: Mapping[str, Any] | None,
        max_fallback: int | None = None,
        remote_tiers: Sequence[Store] = (),
        on_remote_restore: Callable[[Store, GenerationRef], None] | None = None,
        memory_tiers: Sequence[Store] = (),
    ) -> None:
        self.store = run.store
        self.run_id = run.run_id
        self.trust = run.trust
        self.coordinator = run.coordinator
        self.events = run.events
        self.threads = threads
        self.contract_fields = contract_fields
        self.max_fallback = max_fallback  # newer generations restore may skip; None: any
        # The memory tier first, then the local one; remote tiers only when they have
        # nothing that verifies.
        self.memory_tiers = tuple(memory_tiers)
        self.remote_tiers = tuple(remote_tiers)
        self.selectors = [
            CandidateSelector(store, run.run_id, run.trust)
            for store in (*memory_tiers, run.store, *remote_tiers)
        ]
        self.on_remote_restore = on_remote_restore
        self.collective: CollectiveLoader | None = None
        if run.coordinator.world_size > 1:  # many ranks choose and load together
            self.collective = CollectiveLoader(
                run.coordinator,
                [selector.store for selector in self.selectors],
                run.trust.keystore,
                threads,
                TrustPolicy(run_id=run.run_id, trusted_keys=run.trust.trusted),
            )

    def restore(
        self,
        state: MutableMapping[str, Any],
        step: int | None = None,
        strict: bool = True,
        allow_contract_change: bool = False,
        allow_rollback_to: int | None = None,
        options: ApplyOptions | None = None,
    ) -> RestoreInfo | None:
        """See :meth:`ckptvault.CheckpointManager.restore`."""
        clock = StageClock()
        try:
            with cyclic_gc_paused():
                return self._restore(
                    state,
                    step,
                    strict,
                    allow_contract_change,
                    allow_rollback_to,
                    clock,
                    options or ApplyOptions(),
                )
        except CheckpointError as exc:
            if not isinstance(exc, AuditError):
                self._report_refusal(exc, clock)
            raise

    def _restore(
        self,
        state: MutableMapping[str, Any],
        step: int | None,
        strict: bool,
        allow_contract_change: bool,
        allow_rollback_to: int | None,
        clock: StageClock,
        options: ApplyOptions,
    ) -> RestoreInfo | None:
        self.trust.ensure_key_usable(self.run_id)  # crypto-erased runs are gone for good
        into_live = options.in_place and self.collective is None  # one process only
        chosen = self._choose_anywhere(state, step, allow_rollback_to, clock, into_live)
        if chosen is None:
            return None
        store, selection, ref, loaded = chosen
        where = f"generation {ref.generation_id} (step {ref.step})"
        saved_world = saved_world_size(loaded.manifest)
        world = self.coordinator.world_size
        loaded.reset += leave_per_rank_alone(state, loaded.saved, saved_world, world)
        plan, mismatch = None, None
        environment: list[str] = []
        # Gradients saved with include_grads=True land in .grad like any entry.
        with gradient_slots(state, loaded.saved), clock.stage("apply"):
            try:
                if self.contract_fields is not None and not allow_contract_change:
                    compare_contracts(loaded.manifest.contract, self.contract_fields, where)
                environment = check_environment(loaded.manifest.contract, where, options)
                plan = checked_plan(state, loaded.saved, loaded.reset, options, strict, where)
            except CheckpointError as exc:
                mismatch = exc
            if self.collective is not None:
                self.collective.agree_to_apply(mismatch)  # every rank applies, or none
            elif mismatch is not None:
                raise mismatch
            assert plan is not None
            if loaded.pending is not None:  # in_place: the big tensors are still to read
                plan = _read_in_place(state, loaded, plan, options, strict, where)
            plan.apply(where)
        _warn_fallback(ref, selection.skipped)
        rollback = allowed_rollback(selection, ref, self.trust.ledger is not None)
        if self.coordinator.is_coordinator:
            if rollback is not None:
                warn_rollback(rollback, ref, self.run_id)
            self._report_restored(store, ref, selection, rollback, clock)
        if store in self.remote_tiers and self.on_remote_restore is not None:
            self.on_remote_restore(store, ref)  # bring it back to the local tier
        return RestoreInfo(
            step=ref.step,
            generation_id=ref.generation_id,
            path=ref.location,
            skipped=selection.skipped,
            missing=plan.missing,
            unexpected=plan.unexpected,
            mismatched=plan.mismatched,
            bytes=loaded.manifest.total_bytes,
            seconds=clock.elapsed(),
            signer=loaded.signer,
            reset=loaded.reset,
            loaded=plan.loaded,
            casts=plan.casts,
            renamed=plan.renamed,
            environment=environment,
            lineage=Lineage.from_contract(loaded.manifest.contract),
            rolled_back_from=rollback.from_step if rollback is not None else None,
            source="memory" if store in self.memory_tiers else "store",
        )

    def _choose_anywhere(
        self,
        state: MutableMapping[str, Any],
        step: int | None,
        allow_rollback_to: int | None,
        clock: StageClock,
        in_place: bool = False,
    ) -> tuple[Store, Selection, GenerationRef, LoadedGeneration] | None:
        """:meth:`_choose` alone, or with every rank of the job: rank 0 chooses and
        the others load what it names (:mod:`ckptvault.distributed.restore`)."""
        collective = self.collective
        if collective is None:
            return self._choose(step, allow_rollback_to, clock, in_place)
        collective.live = capture_ranked(state, self.coordinator.rank).tensors
        collective.param_hints = optimizer_param_hints(state)
        if not self.coordinator.is_coordinator:
            followed = collective.follow()
            if followed is None:
                return None
            store, ref, loaded, skipped = followed
            policy = TrustPolicy(run_id=self.run_id, trusted_keys=self.trust.trusted)
            done = Selection([ref], [ref], policy, skipped=[SkippedGeneration(*s) for s in skipped])
            return store, done, ref, loaded
        try:
            chosen = self._choose(step, allow_rollback_to, clock)
        except BaseException as exc:
            collective.finish(None, exc)
            raise
        skipped = [(s.generation_id, s.step, s.reason) for s in chosen[1].skipped] if chosen else []
        collective.finish(chosen[2] if chosen else None, None, skipped)
        return chosen

    def _choose(
        self,
        step: int | None,
        allow_rollback_to: int | None,
        clock: StageClock,
        in_place: bool = False,
    ) -> tuple[Store, Selection, GenerationRef, LoadedGeneration] | None:
        """The newest generation that verifies in any tier, trying the local copy of
        each generation before a remote one; None when every tier is empty. When a
        tier has nothing to offer (empty, or without that step) the others still
        count; when no tier has a candidate, the first tier's error is raised."""
        selections: list[tuple[Store, Selection]] = []
        errors: list[NoValidCheckpoint] = []
        for selector in self.selectors:
            try:
                with clock.stage("discovery"):
                    # A tier without the step still shows what is newer than it.
                    selection = selector.select(
                        step, rollback_to=allow_rollback_to, keep_newer=True
                    )
                selections.append((selector.store, selection))
                errors += [selection.absent] if selection.absent is not None else []
            except NoValidCheckpoint as exc:
                errors.append(exc)
        tiers = [(store, selection) for store, selection in selections if selection.candidates]
        if not any(selection.absent is None for _store, selection in tiers):
            if errors:
                raise errors[0]
            return None
        merged, store_of = merge_tiers(tiers)

        def load(ref: GenerationRef, policy: TrustPolicy) -> LoadedGeneration:
            return self._load(store_of[ref.location], ref, policy, clock, in_place)

        def check(ref: GenerationRef, policy: TrustPolicy) -> None:
            self._check(store_of[ref.location], ref, policy, clock)

        ref, loaded = self.selectors[0].first_verified(merged, load, self.max_fallback, check)
        return store_of[ref.location], merged, ref, loaded

    def _load(
        self,
        store: Store,
        ref: GenerationRef,
        policy: TrustPolicy,
        clock: StageClock,
        in_place: bool = False,
    ) -> LoadedGeneration:
        with reading_lease(store, ref):  # released on errors too
            if self.collective is not None:
                with clock.stage("read"):  # many ranks: verification is counted in read
                    return self.collective.load(store, ref, policy)
            return load_verified(
                store,
                ref,
                policy,
                self.trust.keystore,
                self.threads,
                require_encryption=self.trust.keystore is not None,
                clock=clock,
                in_place=in_place,
            )

    def _check(
        self, store: Store, ref: GenerationRef, policy: TrustPolicy, clock: StageClock
    ) -> None:
        """Whether a generation newer than the step asked for would be trusted:
        restore's checks up to the first tensor byte (this process alone, also in a
        job of many ranks: rank 0 chooses)."""
        with reading_lease(store, ref), clock.stage("verification"):
            keystore = self.trust.keystore
            prepare_load(store, ref, policy, keystore, require_encryption=keystore is not None)

    def _report_restored(
        self,
        store: Store,
        ref: GenerationRef,
        selection: Selection,
        rollback: RollbackApplied | None,
        clock: StageClock,
    ) -> None:
        if self.coordinator.is_coordinator:  # the job's records are written once
            self.events.emit(
                Restored(
                    run_id=self.run_id,
                    store=store.location,
                    step=ref.step,
                    generation_id=ref.generation_id,
                    skipped=list(selection.skipped),
                    rollback=rollback,
                    seconds=clock.elapsed(),
                    stages=clock.snapshot(),
                )
            )

    def _report_refusal(self, exc: CheckpointError, clock: StageClock) -> None:
        if not self.coordinator.is_coordinator:
            return
        event = Refused(
            run_id=self.run_id,
            store=self.store.location,
            error=type(exc).__name__,
            reason=str(exc).splitlines()[0][:2000] if str(exc) else type(exc).__name__,
            rejected=list(getattr(exc, "rejected", [])),
            seconds=clock.elapsed(),
            stages=clock.snapshot(),
        )
        try:
            self.events.emit(event)
        except Exception as failure:  # the refusal itself matters more than its record
            logger.error("could not record a refusal: %s", failure)
