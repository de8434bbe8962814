"""The retention plan: a pure function from what a store holds to what happens to it.

:func:`plan_retention` takes the facts about every generation (name, creation time,
metrics, deletion mark, pin, leases, whether it is known to verify), the rollback
floor, what is in flight and the time, and returns one :class:`Decision` per
generation with its reasons. It reads and writes nothing, so every rule and every
safety net is tested without a file (``tests/test_retention.py``); applying a plan
is :mod:`ckptvault.lifecycle.apply`.

Deletion has two phases. A generation that no rule keeps is first *marked*: hidden
from restore and ``ls`` but intact, so ``ckptvault gc --undelete STEP`` can bring it
back. Its bytes go once ``delete_delay`` has passed since the mark (at once when the
delay is 0). A marked generation that a rule or a pin keeps again is unmarked.

Never deleted or marked, whatever the rules say:

- the newest generation known to verify, and everything newer than it (being
  written, or to be looked at by a person);
- an older generation known to verify: a fallback. Until one is known, nothing at
  all is marked or deleted (:attr:`RetentionPlan.needs_verification` names the
  generation whose verification would settle it);
- pinned generations and the restore floor's generation (these also lose a mark);
- generations in flight and generations a reader holds an unexpired lease on
  (their deletion waits; a mark stays).

Generations an allowed rollback abandoned (the ledger's rule) are not restore
candidates and no rule counts them: they are marked like any other dropped
generation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from ckptvault.format.layout import GenerationName, format_timestamp
from ckptvault.lifecycle.retention import RetentionRule, RuleInput
from ckptvault.trust.ledger import RestoreFloor

KEEP = "keep"  # stays as it is
UNMARK = "unmark"  # marked, but kept again: the mark is removed
MARK = "mark"  # marked now; deleted once the delay has passed
MARKED = "marked"  # already marked; waiting for the delay (or a lease) to pass
DELETE = "delete"  # its bytes go now (marked first when it was not)

NEWEST_VERIFIED = "newest verified"
FALLBACK = "fallback (older, verified)"
NEWER_THAN_VERIFIED = "newer than the newest verified generation"
PINNED = "pinned"
FLOOR = "restore floor"
IN_FLIGHT = "in flight"
DROPPED = "no retention rule keeps it"
ABANDONED = "abandoned by an allowed rollback"
GONE = "already gone from the store; finishing its deletion"
NO_RULES = "no retention rule given: only marked generations go"


@dataclass(frozen=True)
class Mark:
    """A deletion mark: when and why."""

    marked_at: datetime
    reason: str


@dataclass(frozen=True)
class GenerationFacts:
    """What the planner knows about one generation."""

    name: GenerationName
    created: datetime
    metrics: Mapping[str, float] | None = None
    mark: Mark | None = None
    pinned: bool = False
    lease_expiries: tuple[datetime, ...] = ()
    verified: bool | None = None  # True: known to verify; False: known not to; None: unknown

    @property
    def step(self) -> int:
        return self.name.step

    @property
    def generation_id(self) -> str:
        return self.name.generation_id


@dataclass(frozen=True)
class Decision:
    name: GenerationName
    action: str
    reasons: tuple[str, ...]
    marked_at: datetime | None = None
    delete_after: datetime | None = None
    listed: bool = True  # False: only its mark is left (finish the deletion everywhere)
    was_marked: bool = False  # it carried a deletion mark when the plan was made

    @property
    def step(self) -> int:
        return self.name.step

    @property
    def generation_id(self) -> str:
        return self.name.generation_id

    @property
    def reason(self) -> str:
        return "; ".join(self.reasons)

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "generation_id": self.generation_id,
            "action": self.action,
            "reasons": list(self.reasons),
            "marked_at": format_timestamp(self.marked_at) if self.marked_at else None,
            "delete_after": format_timestamp(self.delete_after) if self.delete_after else None,
            "listed": self.listed,
            "was_marked": self.was_marked,
        }


@dataclass(frozen=True)
class RetentionPlan:
    now: datetime
    decisions: list[Decision]  # newest first; then marks whose generation is gone
    newest_verified: GenerationName | None = None
    fallback: GenerationName | None = None
    # Why nothing is marked or deleted now, when that is so.
    blocked: str | None = None
    # Verifying this generation could unblock the plan (the applier does, then replans).
    needs_verification: GenerationName | None = None

    def having(self, *actions: str) -> list[Decision]:
        return [d for d in self.decisions if d.action in actions]

    @property
    def changes(self) -> bool:
        return bool(self.having(MARK, UNMARK, DELETE))

    def to_json(self) -> dict[str, Any]:
        def name(n: GenerationName | None) -> dict[str, Any] | None:
            return {"step": n.step, "generation_id": n.generation_id} if n else None

        return {
            "now": format_timestamp(self.now),
            "newest_verified": name(self.newest_verified),
            "fallback": name(self.fallback),
            "blocked": self.blocked,
            "decisions": [d.to_json() for d in self.decisions],
        }


@dataclass
class _Verdict:
    keep: list[str] = field(default_factory=list)  # rules, pins, floor: kept (and unmarked)
    defer: list[str] = field(default_factory=list)  # leases, in flight, a block: not yet


def plan_retention(
    generations: Iterable[GenerationFacts],
    *,
    rules: Sequence[RetentionRule],
    delete_delay: float,
    now: datetime,
    floor: RestoreFloor | None = None,
    in_flight: Iterable[str] = (),
    orphan_marks: Mapping[GenerationName, Mark] | None = None,
) -> RetentionPlan:
    """Decide, for every generation, whether it stays, is marked, unmarked or deleted.

    ``rules`` empty keeps every unmarked generation (``ckptvault gc`` without rule
    options only finishes what was marked before). ``in_flight`` holds generation ids.
    ``orphan_marks`` are marks whose generation the store no longer lists: their
    deletion is finished (other tiers, the mark itself).
    """
    gens = sorted(generations, key=lambda g: g.name, reverse=True)
    ids_in_flight = frozenset(in_flight)
    abandoned = _abandoned(gens, floor)
    eligible = [g for g in gens if g.name not in abandoned]
    verdicts = _rule_verdicts(gens, eligible, rules, now)
    candidates = [g for g in eligible if g.mark is None]  # what a restore may take
    newest, fallback, blocked, needs = _safety_net(candidates)
    _keep_safety_net(verdicts, candidates, newest, fallback)
    for g in gens:
        _hold(verdicts[g.name], g, floor, ids_in_flight, blocked, now)
    decisions = [_decide(g, verdicts[g.name], g.name in abandoned, delete_delay, now) for g in gens]
    decisions += _finish_orphans(orphan_marks or {})
    return RetentionPlan(now, decisions, newest, fallback, blocked, needs)


def _abandoned(gens: list[GenerationFacts], floor: RestoreFloor | None) -> set[GenerationName]:
    """The generations rollbacks abandoned (the ledger's rule): no rule counts them."""
    if floor is None:
        return set()
    # Only what rollbacks abandoned; a step below the floor may still be restored on purpose.
    abandoned_by = floor.without_step()
    return {g.name for g in gens if abandoned_by.refuses(g.step, g.generation_id) is not None}


def _rule_verdicts(
    gens: list[GenerationFacts],
    eligible: list[GenerationFacts],
    rules: Sequence[RetentionRule],
    now: datetime,
) -> dict[GenerationName, _Verdict]:
    """A verdict per generation holding the reasons the rules keep it for (in rule order);
    without rules, every unmarked generation is kept."""
    verdicts = {g.name: _Verdict() for g in gens}
    inputs = [RuleInput(g.name, g.created, g.metrics) for g in eligible]
    for rule in rules:
        for name, reason in rule.keeps(inputs, now).items():
            verdicts[name].keep.append(reason)
    if not rules:
        for g in gens:
            if g.mark is None:
                verdicts[g.name].keep.append(NO_RULES)
    return verdicts


def _keep_safety_net(
    verdicts: dict[GenerationName, _Verdict],
    candidates: list[GenerationFacts],
    newest: GenerationName | None,
    fallback: GenerationName | None,
) -> None:
    """Keep the newest verified generation, everything newer and the fallback: their
    reasons come first."""
    if newest is not None:
        verdicts[newest].keep.insert(0, NEWEST_VERIFIED)
        for g in candidates:
            if g.name == newest:
                break
            verdicts[g.name].keep.insert(0, NEWER_THAN_VERIFIED)
    if fallback is not None:
        verdicts[fallback].keep.insert(0, FALLBACK)


def _hold(
    verdict: _Verdict,
    g: GenerationFacts,
    floor: RestoreFloor | None,
    ids_in_flight: frozenset[str],
    blocked: str | None,
    now: datetime,
) -> None:
    """What keeps ``g`` whatever the rules say (a pin, the floor) and what defers its
    deletion (in flight, a reader's lease, a plan blocked on verification)."""
    if g.pinned:
        verdict.keep.append(PINNED)
    if floor is not None and floor.generation_id == g.generation_id:
        verdict.keep.append(FLOOR)
    if g.generation_id in ids_in_flight:
        verdict.defer.append(IN_FLIGHT)
    leased = [until for until in g.lease_expiries if until > now]
    if leased:
        verdict.defer.append(f"leased by a reader until {format_timestamp(max(leased))}")
    if blocked is not None and not verdict.keep:
        verdict.defer.append(blocked)


def _finish_orphans(orphan_marks: Mapping[GenerationName, Mark]) -> list[Decision]:
    """Deletions to finish: marks whose generation the store no longer lists."""
    return [
        Decision(name, DELETE, (mark.reason, GONE), mark.marked_at, listed=False, was_marked=True)
        for name, mark in sorted(orphan_marks.items(), reverse=True)
    ]


def _safety_net(
    candidates: list[GenerationFacts],
) -> tuple[GenerationName | None, GenerationName | None, str | None, GenerationName | None]:
    """(newest verified, fallback, why nothing may go yet, what to verify to settle it)."""
    newest_index = next((i for i, g in enumerate(candidates) if g.verified is True), None)
    if newest_index is None:
        unknown = next((g.name for g in candidates if g.verified is None), None)
        blocked = "no generation is known to verify yet" if candidates else None
        return None, None, blocked, unknown
    newest = candidates[newest_index].name
    older = candidates[newest_index + 1 :]
    for g in older:
        if g.verified is True:
            return newest, g.name, None, None
        if g.verified is None:
            return newest, None, "no older generation is known to verify yet (a fallback)", g.name
    if older:
        return newest, None, "no older generation verifies (a fallback is kept first)", None
    return newest, None, None, None


def _decide(
    g: GenerationFacts, verdict: _Verdict, abandoned: bool, delay: float, now: datetime
) -> Decision:
    if verdict.keep:
        action = UNMARK if g.mark else KEEP
        return Decision(
            g.name, action, tuple(verdict.keep + verdict.defer), was_marked=bool(g.mark)
        )
    if g.mark is not None:
        delete_after = g.mark.marked_at + timedelta(seconds=delay)
        why = (g.mark.reason, *verdict.defer)
        action = MARKED if verdict.defer or now < delete_after else DELETE
        return Decision(g.name, action, why, g.mark.marked_at, delete_after, was_marked=True)
    if verdict.defer:
        return Decision(g.name, KEEP, tuple(verdict.defer))
    dropped = ABANDONED if abandoned else DROPPED
    return Decision(
        g.name, DELETE if delay == 0 else MARK, (dropped,), now, now + timedelta(seconds=delay)
    )
