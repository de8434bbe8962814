"""Garbage collection of one run's stores: gather the facts, plan, verify, apply.

:class:`GarbageCollector` is shared by the manager's :class:`RetentionKeeper` and by
``ckptvault gc``. It reads what the planner needs from the first store (listing,
marks, pins, leases, and, for ``keep_best``, metrics from manifests through the
bounded structure checks), remembers which generations are known to verify, and
verifies more (every byte, :func:`~ckptvault.trust.checks.verify_generation`) only
when the plan is held back for want of a verified generation or fallback. A
generation a store holds under Object Lock is kept (:mod:`~ckptvault.retention.locks`).
Applying is :class:`~ckptvault.retention.apply.PlanApplier`, over every store.

Everything is known by the generation's *name* (step and id), never by its id alone:
a copy planted under another step with a genuine id is another generation, unknown
until checked. The structure of every generation a rule keeps (each takes a rule's
place) is checked once (:func:`~ckptvault.trust.checks.check_structure`, bounded);
one that fails (its manifest names another generation or run, ...) is not counted
by any rule and is left alone. Marks in any tier whose generation the first store no
longer lists are finished in their own tier only (:class:`~ckptvault.retention.plan.OrphanMark`).

A deletion mark dates a deletion, and a marked generation is no restore candidate, so
retention counts a mark only where restore would and where whoever wrote it could
have deleted the generation anyway: with a ledger, only marks it recorded
(ckptvault's own, as restore counts them); over several tiers, only a mark every tier
holding the generation carries (retention marks them all at once), dated by the
latest of them. A mark planted in one tier alone never advances a deletion in another.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from datetime import datetime, timezone

from ckptvault.errors import CheckpointError, UsageError
from ckptvault.events import Event
from ckptvault.format.layout import GenerationName, generation_id_time
from ckptvault.progress import Progress
from ckptvault.retention.apply import AppliedPlan, PlanApplier
from ckptvault.retention.locks import keep_locked
from ckptvault.retention.marks import read_leases, read_marks, read_orphan_marks, read_pins
from ckptvault.retention.plan import (
    GenerationFacts,
    Mark,
    OrphanMark,
    RetentionPlan,
    plan_retention,
)
from ckptvault.retention.policy import KeepBest, RetentionRule
from ckptvault.retention.vouching import TierVouching
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import (
    UNVERIFIED_SIGNER,
    TrustPolicy,
    VerificationReport,
    check_trusted,
    verify_generation,
)
from ckptvault.trust.ledger import RestoreFloor
from ckptvault.trust.problems import KEY_UNAVAILABLE, UNREADABLE, GenerationRejected, Problem


def _ignore(event: Event) -> None:
    return None


class GarbageCollector:
    """Plans retention from ``stores[0]`` and applies it to every store.

    ``policy`` is what "verifies" means here (run id, trusted keys; never the floor:
    the floor's generation is protected separately).
    """

    def __init__(
        self,
        stores: Sequence[Store],
        rules: Sequence[RetentionRule],
        delete_delay: float,
        *,
        policy: TrustPolicy,
        run_id: str | None = None,
        emit: Callable[[Event], None] = _ignore,
    ) -> None:
        self.applier = PlanApplier(stores, emit, run_id)
        self.store = self.applier.stores[0]
        self.tiers = TierVouching(self.applier.stores[1:], policy)
        self.pin_stores = [self.store]  # whose pins count (a replica's keeper adds the source)
        self.rules = tuple(rules)
        self.delete_delay = delete_delay
        self.policy = policy
        self.known: dict[GenerationName, bool] = {}  # generation -> verifies
        self.reports: list[VerificationReport] = []  # verified here, in order
        self._metrics: dict[GenerationName, dict[str, float] | None] = {}
        self._sound: set[GenerationName] = set()  # passed the structure checks
        self._rejected: dict[GenerationName, str] = {}  # failed them: the problem codes
        self._wants_metrics = any(isinstance(rule, KeepBest) for rule in self.rules)
        # Generations (step and id: a planted copy under another step with a validated
        # id is another generation) a validation loaded and checked, from the catalog
        # when the manager or ``ckptvault gc`` has one: the newest is never pruned.
        self.validated: Callable[[], Collection[GenerationName]] = lambda: ()
        # The marks ckptvault recorded (the ledger's, when the manager or ``ckptvault gc``
        # keeps one): only those count, as in restore. None: no ledger, the store's go.
        self.recorded_marks: Callable[[], Collection[GenerationName] | None] = lambda: None
        # ``ckptvault gc``: refuse generations these trust options cannot authenticate
        # (the manager's keeper trusts exactly what its restore trusts, and goes on).
        self.require_keys = False

    # -- verification ------------------------------------------------------------------

    def verify(self, ref: GenerationRef, progress: Progress | None = None) -> VerificationReport:
        """Verify every byte of ``ref`` and remember the verdict; ``progress(done,
        total)`` follows the bytes hashed (:func:`~ckptvault.trust.checks.verify_generation`)."""
        report = verify_generation(self.store, ref, self.policy, progress=progress)
        self._refuse_unauthenticated(ref, {p.code for p in report.problems}, report.signer)
        self.known[ref.name] = report.ok
        if report.manifest is not None:
            self._sound.add(ref.name)
            if report.ok:
                metrics = report.manifest.metrics
                self._metrics[ref.name] = dict(metrics) if metrics else None
        else:
            self._reject(ref.name, report.problems, {})
        self.reports.append(report)
        return report

    def verify_newest(
        self, now: datetime | None = None, progress: Progress | None = None
    ) -> VerificationReport | None:
        """Verify unmarked generations newest first until one verifies (``ckptvault gc``
        does this before it deletes anything); None when none does. ``progress`` is
        given each verification's bytes in turn (``done`` starts at 0 for each)."""
        refs = self.store.list_generations()
        marks = read_marks(self.store, now or datetime.now(timezone.utc), [r.name for r in refs])
        for ref in refs:
            if ref.name in marks:
                continue
            if self.known.get(ref.name) is False or ref.name in self._rejected:
                continue
            report = self.verify(ref, progress)
            if report.ok:
                return report
        return None

    # -- planning and applying -----------------------------------------------------------

    def plan(
        self,
        *,
        now: datetime | None = None,
        floor: RestoreFloor | None = None,
        in_flight: Iterable[str] = (),
        uncounted: Iterable[str] = (),
    ) -> RetentionPlan:
        """The plan for now (``in_flight`` and ``uncounted``: see
        :func:`~ckptvault.retention.plan.plan_retention`). When it is held back only because a generation's
        verification is unknown (no verified newest, no fallback yet) and something
        would go otherwise, that generation is verified and the plan made again."""
        now = now or datetime.now(timezone.utc)
        in_flight = frozenset(in_flight)
        uncounted = frozenset(uncounted)
        transient: dict[GenerationName, str] = {}  # could not be checked in this pass
        while True:
            plan, refs = self._plan_once(now, floor, in_flight, uncounted, transient)
            # A generation a rule keeps takes a rule's place: only if it is sound.
            unchecked = [
                refs[name]
                for name in sorted(plan.kept_by_rules, reverse=True)
                if not self._checked(name, transient)
            ]
            rejected = [ref for ref in unchecked if self._check(ref, transient) is not None]
            if rejected or self.tiers.check(sorted(plan.kept_by_rules, reverse=True)):
                continue  # plan again: no rule counts them
            target = plan.needs_verification
            held_back = plan.blocked is not None and any(
                plan.blocked in decision.reasons for decision in plan.decisions
            )
            if target is None or not held_back or target in self.known:
                return keep_locked(plan, self.applier.stores)  # Object Lock outranks the rules
            self.verify(refs[target])

    def apply(self, plan: RetentionPlan, progress: Progress | None = None) -> AppliedPlan:
        """Apply ``plan`` to every store; ``progress`` counts its marks, unmarks and
        deletions as each is done."""
        return self.applier.apply(plan, progress)

    def _plan_once(
        self,
        now: datetime,
        floor: RestoreFloor | None,
        in_flight: frozenset[str],
        uncounted: frozenset[str],
        transient: dict[GenerationName, str],
    ) -> tuple[RetentionPlan, dict[GenerationName, GenerationRef]]:
        refs = self.store.list_generations()
        self.tiers.list_tiers()
        listed = [ref.name for ref in refs]
        marks = self._marks(now, listed)
        pins = set().union(*(read_pins(store, listed) for store in self.pin_stores))
        leases = read_leases(self.store, now, listed)
        validated = frozenset(self.validated())
        facts = [
            GenerationFacts(
                name=ref.name,
                created=generation_id_time(ref.generation_id),
                metrics=self._metrics_of(ref, transient),
                mark=marks.get(ref.name),
                pinned=ref.name in pins,
                lease_expiries=tuple(leases.get(ref.name, ())),
                verified=self.known.get(ref.name),
                rejected=self._rejected.get(ref.name) or transient.get(ref.name),
                unvouched=self.tiers.unvouched(ref.name),
                validated=ref.name in validated,
            )
            for ref in refs
        ]
        orphans = self._orphans(now, listed)
        plan = plan_retention(
            facts,
            rules=self.rules,
            delete_delay=self.delete_delay,
            now=now,
            floor=floor,
            in_flight=in_flight,
            orphan_marks=orphans,
            uncounted=uncounted,
            home=self.store.location if self.tiers.tiers else None,
        )
        return plan, {ref.name: ref for ref in refs}

    def _marks(self, now: datetime, listed: list[GenerationName]) -> dict[GenerationName, Mark]:
        """The marks of ``listed`` that retention goes by (see the module docstring): the
        first store's, each carried by every other tier that holds the generation too
        (then dated by the latest), and recorded by the ledger when there is one."""
        marks = read_marks(self.store, now, listed)
        for tier in self.tiers.tiers:
            held = [name for name in marks if self.tiers.holds(tier, name)]
            theirs = read_marks(tier, now, held) if held else {}
            for name in held:
                if name in theirs:
                    marks[name] = max(marks[name], theirs[name], key=_mark_order)
                else:
                    del marks[name]  # one tier's alone: it decides nothing for the others
        recorded = self.recorded_marks()
        if recorded is not None:
            recorded = frozenset(recorded)
            marks = {name: mark for name, mark in marks.items() if name in recorded}
        return marks

    def _orphans(self, now: datetime, listed: list[GenerationName]) -> list[OrphanMark]:
        """Each tier's marks of generations the first store does not list, with what
        keeps them there: a pin (here or in that tier), a lease (in any tier)."""
        orphans = []
        for tier in self.applier.stores:
            marks = read_orphan_marks(tier, now, listed)
            if not marks:
                continue
            names = list(marks)
            pinned = set().union(*(read_pins(s, names) for s in (*self.pin_stores, tier)))
            leases: dict[GenerationName, list[datetime]] = {}
            for store in self.applier.stores:
                for name, expiries in read_leases(store, now, names).items():
                    leases.setdefault(name, []).extend(expiries)
            orphans += [
                OrphanMark(name, mark, tier.location, name in pinned, tuple(leases.get(name, ())))
                for name, mark in marks.items()
            ]
        return orphans

    # -- the structure checks -------------------------------------------------------------

    def _checked(self, name: GenerationName, transient: dict[GenerationName, str]) -> bool:
        """Whether ``name``'s structure is known (a generation known to verify is sound)."""
        return (
            self.known.get(name) is True
            or name in self._sound
            or name in self._rejected
            or name in transient
        )

    def _check(self, ref: GenerationRef, transient: dict[GenerationName, str]) -> str | None:
        """Apply the structure checks to ``ref`` once (and read its metrics, when a rule
        ranks by them); why it fails them, or None."""
        if ref.name in self._sound and (ref.name in self._metrics or not self._wants_metrics):
            return None
        if ref.name in self._rejected or ref.name in transient:
            return self._rejected.get(ref.name) or transient[ref.name]
        try:
            checked = check_trusted(self.store, ref, self.policy)
        except GenerationRejected as rejected:
            self._refuse_unauthenticated(ref, rejected.codes, None)
            return self._reject(ref.name, rejected.problems, transient)
        except (CheckpointError, OSError) as exc:
            transient[ref.name] = f"could not be checked: {exc}"  # ask again next pass
            return transient[ref.name]
        self._refuse_unauthenticated(ref, set(), checked.signer)
        self._sound.add(ref.name)  # generations are immutable: checked once
        metrics = checked.manifest.metrics
        self._metrics[ref.name] = dict(metrics) if metrics else None
        return None

    def _refuse_unauthenticated(
        self, ref: GenerationRef, codes: set[str], signer: str | None
    ) -> None:
        """With ``require_keys`` (``ckptvault gc``): refuse a store whose generations
        these options cannot authenticate, before anything is marked. An encrypted
        generation read without the key store, or a signed one without trusted keys,
        cannot be told from a forgery, so no rule could trust what it counts."""
        if not self.require_keys:
            return
        option = None
        if KEY_UNAVAILABLE in codes and self.policy.keystore is None:
            option, what = "--keystore", "is encrypted"
        elif signer == UNVERIFIED_SIGNER and self.policy.trusted_keys is None:
            option, what = "--trusted-key", "is signed"
        if option is not None:
            raise UsageError(
                f"generation {ref.generation_id} (step {ref.step}) in {self.store.location} "
                f"{what}, and without {option} gc cannot tell it from a forgery: pass "
                f"{option}. Nothing was marked or deleted"
            )

    def _reject(
        self, name: GenerationName, problems: list[Problem], transient: dict[GenerationName, str]
    ) -> str:
        why = ", ".join(sorted({problem.code for problem in problems}))
        if any(problem.code == UNREADABLE for problem in problems):
            transient[name] = why  # perhaps for now only: ask again next pass
        else:
            self._rejected[name] = why
        return why

    def _metrics_of(
        self, ref: GenerationRef, transient: dict[GenerationName, str]
    ) -> dict[str, float] | None:
        """The metrics ``ref`` recorded, read through the structure checks (what a bad
        generation claims is not believed)."""
        if not self._wants_metrics:
            return None
        if ref.name not in self._metrics:
            self._check(ref, transient)
        return self._metrics.get(ref.name)


def _mark_order(mark: Mark) -> tuple[datetime, bool]:
    """Later marks first; an undated one (counted from now) wins a tie."""
    return mark.marked_at, mark.undated
