"""Which generations a reader may take, and in what order: the one candidate loop.

Restore, the weights-only export and ``ckptvault verify`` all choose through a
:class:`CandidateSelector`, so they agree on what "the newest generation of step N"
means, on the rollback floor and its override, and on what an empty store means.
:meth:`CandidateSelector.first_verified` then tries candidates newest first with a
caller's load function until one verifies, collecting why each newer one was
skipped; restore bounds how many it may skip (``max_fallback``), so a damaged or
tampered store cannot silently push a run back. A generation retention marked for
deletion is no candidate (``ckptvault gc --undelete`` brings it back). Nothing here
imports torch.

With a ledger, a step asked for by name is held to what restore would have taken
without it: the generations above that step that ``restore(state)`` would try first
(listed, or published per the ledger and gone; not abandoned) come first among the
candidates, marked ``newer``. One that passes the caller's check makes the restore a
rollback (``RollbackError``, unless ``allow_rollback_to`` names the step); those that
fail are skipped and counted by ``max_fallback``, as restore's newest-first loop
counts them. So a planted pointer, an old path or a hidden newest generation cannot
turn an explicit step into a silent rollback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from ckptvault.config import validate_step
from ckptvault.errors import CheckpointError, NoValidCheckpoint, RollbackError, UsageError
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.storage.records import DELETION_MARK
from ckptvault.trust.checks import TrustPolicy
from ckptvault.trust.context import TrustContext
from ckptvault.trust.ledger import RestoreFloor
from ckptvault.trust.problems import GENERATION_MISSING, ROLLBACK, GenerationRejected, Problem

T = TypeVar("T")
logger = logging.getLogger("ckptvault")


class SkippedGeneration(NamedTuple):
    generation_id: str
    step: int
    reason: str


@dataclass(frozen=True)
class Selection:
    """The candidates to try, newest first, and the rules they are held to."""

    candidates: list[GenerationRef]
    listed: list[GenerationRef]  # every generation in the store
    policy: TrustPolicy
    previous_floor: RestoreFloor | None = None  # the floor before a rollback override
    rollback_to: int | None = None
    rewinds_run: bool = True  # a restore (it can roll back on purpose); export does not
    # Published generations (per the ledger) that are no longer listed: candidates that
    # always fail, so that hiding the newest generations is a loud, bounded fallback.
    missing: frozenset[GenerationRef] = frozenset()  # the placeholders among candidates
    skipped: list[SkippedGeneration] = field(default_factory=list)
    step: int | None = None  # the step asked for (by step= or allow_rollback_to=)
    # With a ledger and a step asked for: the candidates above it that restore(state)
    # would try first. They are only checked (see the module docstring), never loaded.
    newer: frozenset[GenerationRef] = frozenset()
    # The newest of ``newer`` that passed its check, when the rollback was allowed.
    passed_over: list[GenerationRef] = field(default_factory=list)
    # select(keep_newer=True) in a store without the step asked for: why (the
    # candidates are then only ``newer``: another tier may hold the step).
    absent: NoValidCheckpoint | None = None
    # The ids of the run's publishes the ledger recorded: a rollback's cutoff sorts
    # after them all (:func:`~ckptvault.trust.ledger.rollback_cutoff`).
    published: frozenset[str] = frozenset()


def summarize_steps(steps: list[int]) -> str:
    if len(steps) <= 12:
        return ", ".join(str(s) for s in steps)
    return ", ".join(str(s) for s in steps[:5]) + ", ..., " + ", ".join(str(s) for s in steps[-5:])


class CandidateSelector:
    """Chooses among a store's generations for one run under one trust context.

    ``run_id=None`` accepts any run (``verify`` without ``--run-id``).
    """

    def __init__(self, store: Store, run_id: str | None, trust: TrustContext) -> None:
        self.store = store
        self.run_id = run_id
        self.trust = trust

    def select(
        self,
        step: int | None = None,
        *,
        rollback_to: int | None = None,
        floor_applies: bool = True,
        keep_newer: bool = False,
    ) -> Selection:
        """The generations to try: all, or those of ``step``, newest first.

        ``rollback_to=STEP`` selects STEP even below the floor (abandoned generations
        stay refused). ``floor_applies=False`` enforces only abandonment (export may
        read an old step; it never rewinds a run). An empty store gives an empty
        selection, except that a run that restored before refuses to start over
        (``RollbackError``); a missing step is ``NoValidCheckpoint``. With a ledger
        and a step, the generations above it come first, marked ``newer`` (see the
        module docstring). ``keep_newer=True`` (one tier of several): a store without
        the step still gives its ``newer`` generations, the error in ``absent``.
        """
        if rollback_to is not None:
            rollback_to = validate_step(rollback_to, "allow_rollback_to")
            if step is not None and step != rollback_to:
                raise UsageError(
                    f"step={step} and allow_rollback_to={rollback_to} disagree; give one"
                )
            step = rollback_to
        if step is not None:
            step = validate_step(step)
        listed = self.store.list_generations()
        previous = self.trust.floor(self.run_id) if self.run_id is not None else None
        if rollback_to is not None and previous is not None:
            self._refuse_repeated_rollback(previous, rollback_to)
        floor = previous
        if previous is not None and (rollback_to is not None or not floor_applies):
            # Below the floor is the point; abandoned stays abandoned.
            floor = previous.without_step()
        policy = self.trust.policy(self.run_id, floor)
        vanished = (
            self._vanished(listed, floor, lambda s: step is None or s == step)
            if floor_applies and rollback_to is None
            else []
        )
        absent = None
        if not listed:  # a floor says more than what vanished; with neither: empty
            absent = self._empty_store_error(floor, step, quietly=not vanished)
        candidates = listed if step is None else [ref for ref in listed if ref.step == step]
        candidates = self._without_marked(candidates, step)
        if listed and not candidates and not vanished:
            present = summarize_steps(sorted({ref.step for ref in listed}))
            absent = NoValidCheckpoint(
                f"store {self.store.location} has no generation of step {step}; "
                f"steps present: {present}"
            )
        newer = self._newer(listed, step, floor) if floor_applies else []
        if absent is not None and not (keep_newer and newer):
            raise absent
        shown = set(listed)
        missing = frozenset([*vanished, *(ref for ref in newer if ref not in shown)])
        if vanished or newer:
            candidates = sorted(newer + candidates + vanished, key=lambda r: r.name, reverse=True)
        return Selection(
            candidates,
            listed,
            policy,
            previous,
            rollback_to,
            floor_applies,
            missing=missing,
            step=step,
            newer=frozenset(newer),
            absent=absent,
            published=frozenset(
                name.generation_id
                for name in (self.trust.published(self.run_id) if self.run_id is not None else [])
            ),
        )

    def _newer(
        self, listed: list[GenerationRef], step: int | None, floor: RestoreFloor | None
    ) -> list[GenerationRef]:
        """With a ledger: the generations above ``step`` that ``restore(state)`` would
        try before it (listed and not marked, or published and gone), less those the
        floor refuses. None without a ledger, without a step, or when the floor
        refuses ``step`` itself (that refusal says it already)."""
        if step is None or self.run_id is None or self.trust.ledger is None or floor is None:
            return []
        if floor.step is not None and step < floor.step:
            return []
        asked = step
        above = [ref for ref in listed if ref.step > asked]
        marked = self._marked(above)
        above = [ref for ref in above if ref.name.dirname not in marked]
        gone = self._vanished(listed, floor, lambda s: s > asked)
        return [
            ref for ref in [*above, *gone] if floor.refuses(ref.step, ref.generation_id) is None
        ]

    def _refuse_repeated_rollback(self, floor: RestoreFloor, step: int) -> None:
        """A rollback to ``step`` was made before and the run has published since:
        ``RollbackError``. A requeued job passes the same ``allow_rollback_to`` on every
        start; applied again, it would abandon everything saved since the first time."""
        made = [rule for rule in floor.rules if rule.floor_step == step]
        if not made or self.run_id is None:
            return
        rule = max(made)  # the latest rollback to this step
        since = [n for n in self.trust.published(self.run_id) if n.generation_id > rule.cutoff]
        if not since:
            return  # nothing saved since: applying it again changes nothing
        newest = max(since)
        raise RollbackError(
            f"run {self.run_id!r} already rolled back to step {step} (at {rule.created_at}) "
            f"and has published since (newest: step {newest.step}, generation "
            f"{newest.generation_id}): allow_rollback_to={step} is applied once, so that a "
            "job requeued with the same option does not abandon that work. Nothing was "
            "loaded and state is unchanged. Drop allow_rollback_to to resume the newest "
            f"generation; to go back to step {step} once more, start a new run from it "
            "(CheckpointManager.warm_start)"
        )

    def _vanished(
        self,
        listed: list[GenerationRef],
        floor: RestoreFloor | None,
        wanted: Callable[[int], bool],
    ) -> list[GenerationRef]:
        """Generations the ledger saw published for this run, of a ``wanted`` step,
        that the store no longer lists (deleted by hand, or hidden), and that the
        floor would still accept."""
        if self.run_id is None:
            return []
        present = {ref.name for ref in listed}
        return [
            GenerationRef(name, f"{self.store.location}/{name.dirname}")
            for name in self.trust.published(self.run_id)
            if name not in present
            and wanted(name.step)
            and (floor is None or floor.refuses(name.step, name.generation_id) is None)
        ]

    def _marked(self, refs: list[GenerationRef]) -> set[str]:
        """The directory names among ``refs`` that retention marked for deletion (with
        a ledger: only marks it recorded; a mark planted in the store is ignored)."""
        if not refs:
            return set()
        # Only the candidates' own marks are read: marks of other names (planted by
        # the thousand, say) are never opened, only listed.
        dirnames = {ref.name.dirname for ref in refs}
        try:
            marked = set(self.store.list_records(DELETION_MARK, dirnames.__contains__))
        except (OSError, CheckpointError) as exc:  # marks only ever withhold: go on without
            logger.warning("cannot read the deletion marks of %s: %s", self.store.location, exc)
            return set()
        recorded = self.trust.recorded_marks(self.run_id) if self.run_id is not None else None
        if recorded is not None:
            # With a ledger, only marks ckptvault itself made withhold a generation: a
            # mark planted in the store must not roll the run back quietly.
            planted = {ref.name.dirname for ref in refs if ref.name not in recorded} & marked
            if planted:
                logger.warning(
                    "ignoring deletion marks the ledger has no record of in %s: %s",
                    self.store.location,
                    ", ".join(sorted(planted)),
                )
            marked -= planted
        return marked

    def _without_marked(self, refs: list[GenerationRef], step: int | None) -> list[GenerationRef]:
        """``refs`` less those marked for deletion; when that leaves none, the marks
        are the reason (restore must not start over quietly from an empty-looking store)."""
        marked = self._marked(refs)
        kept = [ref for ref in refs if ref.name.dirname not in marked]
        if refs and not kept:
            which = f"every generation of step {step}" if step is not None else "every generation"
            raise NoValidCheckpoint(
                f"{which} in {self.store.location} is marked for deletion by retention; bring "
                f"one back with `ckptvault gc {self.store.location} --undelete STEP` before it "
                "is deleted"
            )
        return kept

    def _empty_store_error(
        self, floor: RestoreFloor | None, step: int | None, quietly: bool = True
    ) -> NoValidCheckpoint | None:
        """An empty store is a fresh start only when nothing says otherwise: raises
        ``RollbackError`` when the run restored before; the error for a step asked for."""
        if floor is not None and floor.step is not None:
            raise RollbackError(
                f"store {self.store.location} holds no generation, but run {self.run_id!r} "
                f"restored step {floor.step} before: refusing to start over silently. Restore "
                "the store from a copy, or start a new run id"
            )
        if step is not None and quietly:
            return NoValidCheckpoint(
                f"store {self.store.location} holds no generation (asked for step {step})"
            )
        return None

    def first_verified(
        self,
        selection: Selection,
        load: Callable[[GenerationRef, TrustPolicy], T],
        max_fallback: int | None = None,
        check: Callable[[GenerationRef, TrustPolicy], object] | None = None,
    ) -> tuple[GenerationRef, T]:
        """Try candidates newest first; the first that ``load`` accepts wins.

        ``load`` raises :class:`GenerationRejected` for a generation that fails a
        check; it is recorded in ``selection.skipped`` and the next one is tried.
        When none verifies: ``RollbackError`` if any was refused for the floor,
        otherwise ``NoValidCheckpoint``, each listing every rejection.

        ``max_fallback=N`` (restore only; ``None`` is unbounded): once more than N
        candidates failed verification, ``RollbackError`` instead of trying an older
        one. Generations refused for the floor (abandoned by an allowed rollback) do
        not count: skipping them is the ledger's decision, not a fallback.

        ``selection.newer`` candidates are only checked, with ``check`` (default
        ``load``): one that passes is ``RollbackError`` (the step asked for would roll
        the run back), or, when the rollback is allowed, noted in
        ``selection.passed_over``; one that fails is skipped and counted as above
        (when allowed: neither, it is being abandoned on purpose).
        """
        refused_for_floor = False
        failed = 0
        for ref in selection.candidates:
            newer = ref in selection.newer
            allowed = newer and selection.rollback_to is not None
            if allowed and selection.passed_over:
                continue  # the newest passing one is known; the rest go with it
            if max_fallback is not None and failed > max_fallback and not allowed:
                raise self._too_many_skipped(selection, ref, failed, max_fallback)
            try:
                if ref in selection.missing:
                    raise GenerationRejected(ref, [_missing_problem(ref, self.store)])
                if not newer:
                    return ref, load(ref, selection.policy)
                (check or load)(ref, selection.policy)
                if not allowed:
                    raise self._explicit_rollback(selection, ref)
                selection.passed_over.append(ref)
            except GenerationRejected as rejected:
                if allowed:
                    continue
                logger.warning("skipping %s: %s", ref.location, rejected.reason)
                selection.skipped.append(
                    SkippedGeneration(ref.generation_id, ref.step, rejected.reason)
                )
                refused_for_floor |= ROLLBACK in rejected.codes
                failed += ROLLBACK not in rejected.codes
        raise self._none_verified(selection, refused_for_floor)

    def _explicit_rollback(self, selection: Selection, newer: GenerationRef) -> RollbackError:
        asked = selection.step
        rejected = [(s.generation_id, s.step, s.reason) for s in selection.skipped]
        return RollbackError(
            f"step {asked} is older than generation {newer.generation_id} (step {newer.step}) "
            f"of run {self.run_id!r} at {newer.location}, which passes every check that needs "
            "no tensor byte (signature, run, files, sizes, headers): restoring "
            f"step {asked} would roll the run back. Nothing was loaded and state is unchanged. "
            "A checkpoint path or pointer naming an old step is only a hint: resume the newest "
            f"with restore(state), or roll back on purpose with allow_rollback_to={asked} (the "
            "newer generations are then abandoned, and the rollback is audited)",
            rejected,
        )

    def _too_many_skipped(
        self, selection: Selection, next_ref: GenerationRef, failed: int, max_fallback: int
    ) -> RollbackError:
        rejected = [(s.generation_id, s.step, s.reason) for s in selection.skipped]
        # With a ledger, an older step asked for by name is a rollback too.
        on_purpose = "allow_rollback_to" if selection.policy.floor is not None else "step"
        return RollbackError(
            f"{failed} newer generation(s) of run {self.run_id!r} in {self.store.location} failed "
            f"verification, more than max_fallback={max_fallback} allows: refusing to fall back "
            f"further (the next candidate is step {next_ref.step}, generation "
            f"{next_ref.generation_id}). Nothing was loaded and state is unchanged. The store "
            "may be damaged or tampered with: restore it from a good copy, or raise "
            f"max_fallback, or restore a step on purpose with "
            f"restore(state, {on_purpose}={next_ref.step})",
            rejected,
        )

    def _none_verified(self, selection: Selection, refused_for_floor: bool) -> NoValidCheckpoint:
        rejected = [(s.generation_id, s.step, s.reason) for s in selection.skipped]
        floor = selection.policy.floor
        if refused_for_floor and floor is not None and selection.rewinds_run:
            above = (
                f"at or above the restore floor (step {floor.step})"
                if floor.step is not None
                else "that was not abandoned"
            )
            return RollbackError(
                f"no generation of run {self.run_id!r} {above} passed verification; refusing to "
                "roll back silently. Restore from a good copy, or pass allow_rollback_to=STEP to "
                "roll back on purpose",
                rejected,
            )
        return NoValidCheckpoint(
            f"no generation in {self.store.location} passed verification; nothing was loaded "
            "and state is unchanged. Run `ckptvault verify --all` on the store for details",
            rejected,
        )


def _missing_problem(ref: GenerationRef, store: Store) -> Problem:
    return Problem(
        GENERATION_MISSING,
        f"generation {ref.generation_id} (step {ref.step}) was published, as the ledger "
        f"records, but {store.location} no longer holds it: it was deleted or hidden by "
        "something other than ckptvault's retention",
    )
