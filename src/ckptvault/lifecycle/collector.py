"""Garbage collection of one run's stores: gather the facts, plan, verify, apply.

:class:`GarbageCollector` is shared by the manager's :class:`RetentionKeeper` and by
``ckptvault gc``. It reads what the planner needs from the first store (listing,
marks, pins, leases, and, for ``keep_best``, metrics from manifests through the
bounded structure checks), remembers which generations are known to verify, and
verifies more (every byte, :func:`~ckptvault.trust.checks.verify_generation`) only
when the plan is held back for want of a verified generation or fallback. A
generation a store holds under Object Lock is kept (:mod:`~ckptvault.lifecycle.locks`).
Applying is :class:`~ckptvault.lifecycle.apply.PlanApplier`, over every store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import datetime, timezone

from ckptvault.events import Event
from ckptvault.format.layout import generation_id_time
from ckptvault.lifecycle.apply import AppliedPlan, PlanApplier
from ckptvault.lifecycle.locks import keep_locked
from ckptvault.lifecycle.marks import read_leases, read_marks, read_pins
from ckptvault.lifecycle.metrics import read_metrics
from ckptvault.lifecycle.plan import GenerationFacts, RetentionPlan, plan_retention
from ckptvault.lifecycle.retention import KeepBest, RetentionRule
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import TrustPolicy, VerificationReport, verify_generation
from ckptvault.trust.ledger import RestoreFloor


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
        self.pin_stores = [self.store]  # whose pins count (a replica's keeper adds the source)
        self.rules = tuple(rules)
        self.delete_delay = delete_delay
        self.policy = policy
        self.known: dict[str, bool] = {}  # generation id -> verifies
        self.reports: list[VerificationReport] = []  # verified here, in order
        self._metrics: dict[str, dict[str, float] | None] = {}
        self._wants_metrics = any(isinstance(rule, KeepBest) for rule in self.rules)

    # -- verification ------------------------------------------------------------------

    def verify(self, ref: GenerationRef) -> VerificationReport:
        """Verify every byte of ``ref`` and remember the verdict."""
        report = verify_generation(self.store, ref, self.policy)
        self.known[ref.generation_id] = report.ok
        if report.manifest is not None and report.ok:
            metrics = report.manifest.metrics
            self._metrics[ref.generation_id] = dict(metrics) if metrics else None
        self.reports.append(report)
        return report

    def verify_newest(self, now: datetime | None = None) -> VerificationReport | None:
        """Verify unmarked generations newest first until one verifies (``ckptvault gc``
        does this before it deletes anything); None when none does."""
        marks = read_marks(self.store, now or datetime.now(timezone.utc))
        for ref in self.store.list_generations():
            if ref.name in marks:
                continue
            if self.known.get(ref.generation_id) is False:
                continue
            report = self.verify(ref)
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
    ) -> RetentionPlan:
        """The plan for now. When it is held back only because a generation's
        verification is unknown (no verified newest, no fallback yet) and something
        would go otherwise, that generation is verified and the plan made again."""
        now = now or datetime.now(timezone.utc)
        in_flight = frozenset(in_flight)
        while True:
            plan, refs = self._plan_once(now, floor, in_flight)
            target = plan.needs_verification
            held_back = plan.blocked is not None and any(
                plan.blocked in decision.reasons for decision in plan.decisions
            )
            if target is None or not held_back or target.generation_id in self.known:
                return keep_locked(plan, self.applier.stores)  # Object Lock outranks the rules
            self.verify(refs[target.generation_id])

    def apply(self, plan: RetentionPlan) -> AppliedPlan:
        return self.applier.apply(plan)

    def _plan_once(
        self, now: datetime, floor: RestoreFloor | None, in_flight: frozenset[str]
    ) -> tuple[RetentionPlan, dict[str, GenerationRef]]:
        refs = self.store.list_generations()
        marks = read_marks(self.store, now)
        pins = set().union(*(read_pins(store) for store in self.pin_stores))
        leases = read_leases(self.store)
        facts = [
            GenerationFacts(
                name=ref.name,
                created=generation_id_time(ref.generation_id),
                metrics=self._metrics_of(ref),
                mark=marks.get(ref.name),
                pinned=ref.name in pins,
                lease_expiries=tuple(leases.get(ref.name, ())),
                verified=self.known.get(ref.generation_id),
            )
            for ref in refs
        ]
        listed = {ref.name for ref in refs}
        orphans = {name: mark for name, mark in marks.items() if name not in listed}
        plan = plan_retention(
            facts,
            rules=self.rules,
            delete_delay=self.delete_delay,
            now=now,
            floor=floor,
            in_flight=in_flight,
            orphan_marks=orphans,
        )
        return plan, {ref.generation_id: ref for ref in refs}

    def _metrics_of(self, ref: GenerationRef) -> dict[str, float] | None:
        if not self._wants_metrics:
            return None
        if ref.generation_id not in self._metrics:  # generations are immutable: read once
            self._metrics[ref.generation_id] = read_metrics(self.store, ref, self.policy)
        return self._metrics[ref.generation_id]
