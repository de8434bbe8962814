"""The retention plan: a pure function from what a store holds to what happens to it.

:func:`plan_retention` takes the facts about every generation (name, creation time,
metrics, deletion mark, pin, leases, whether it is known to verify), the rollback
floor, what is in flight and the time, and returns one :class:`Decision` per
generation with its reasons. It reads and writes nothing, so every rule and every
safety net is tested without a file (``tests/unit/test_retention.py``); applying a plan
is :mod:`ckptvault.retention.apply`.

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
- the newest validated generation (loaded into fresh objects and checked: seed 001's
  "a checkpoint that has never been loaded is not a checkpoint yet"; it loses a mark);
- generations in flight and generations a reader holds an unexpired lease on
  (their deletion waits; a mark stays);
- generations ``uncounted`` names (with one policy over two tiers: those not yet
  copied to the replica) are kept, and no rule counts them: otherwise, while copies
  lag, the newest uncopied generations would take the rules' places and the copied
  ones would go from both tiers, leaving the replica nothing to restore;
- a generation that fails the checks restore applies before reading a tensor byte
  (its manifest does not name it, is not this run's, is unsigned, its MAC does not
  check, ...; :attr:`GenerationFacts.rejected`) while a rule would keep it were it
  sound: it never verifies and no rule counts it (so planted copies cannot take the
  places of genuine generations), but in another tier a genuine copy may bear its
  name, so retention leaves it alone. Once no rule would keep it, it goes like any
  other dropped generation. One that another tier of the plan cannot vouch for (no
  copy there, or a copy that fails those checks: :attr:`GenerationFacts.unvouched`)
  is treated the same way, so that a deletion in a tier is never decided by a
  generation that tier does not hold. Counting fewer generations never drops one
  that counting them all would keep: every rule keeps at least as much of what it
  counts when there is less to count.

Generations an allowed rollback abandoned (the ledger's rule) are not restore
candidates and no rule counts them: they are marked like any other dropped
generation.

A mark whose generation the planned store no longer lists (an *orphan*: a deletion
cut short, or a planted record) is finished only in the tier that carries it
(:class:`OrphanMark`), once its delay has passed, and never while a pin, the restore
floor or a lease keeps its generation. Times from records are bounded: date
arithmetic saturates instead of overflowing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone

from ckptvault.format.layout import GenerationName, format_timestamp
from ckptvault.retention.decisions import (
    ABANDONED,
    DELETE,
    DROPPED,
    FALLBACK,
    FLOOR,
    GONE,
    IN_FLIGHT,
    KEEP,
    MARK,
    MARKED,
    NEWER_THAN_VERIFIED,
    NEWEST_VALIDATED,
    NEWEST_VERIFIED,
    NO_RULES,
    PINNED,
    REDATED,
    REJECTED,
    UNMARK,
    Decision,
    GenerationFacts,
    Mark,
    OrphanMark,
    RetentionPlan,
)
from ckptvault.retention.policy import RetentionRule, RuleInput
from ckptvault.trust.ledger import RestoreFloor

_LATEST = datetime.max.replace(tzinfo=timezone.utc)

__all__ = [
    "ABANDONED",
    "DELETE",
    "DROPPED",
    "FALLBACK",
    "FLOOR",
    "GONE",
    "IN_FLIGHT",
    "KEEP",
    "MARK",
    "MARKED",
    "NEWER_THAN_VERIFIED",
    "NEWEST_VERIFIED",
    "NO_RULES",
    "PINNED",
    "REDATED",
    "REJECTED",
    "UNMARK",
    "Decision",
    "GenerationFacts",
    "Mark",
    "OrphanMark",
    "RetentionPlan",
    "plan_retention",
]


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
    orphan_marks: Iterable[OrphanMark] = (),
    uncounted: Iterable[str] = (),
    home: str | None = None,
) -> RetentionPlan:
    """Decide, for every generation, whether it stays, is marked, unmarked or deleted.

    ``rules`` empty keeps every unmarked generation (``ckptvault gc`` without rule
    options only finishes what was marked before). ``in_flight`` holds generation ids;
    ``uncounted`` too: those are kept as in flight, and no rule counts them.
    ``orphan_marks`` are marks whose generation the store no longer lists: their
    deletion is finished in the tier that carries each (its copy there, the mark).
    ``home`` (a plan over several tiers) is the location of the tier the facts come
    from: a generation whose copy there fails the checks says nothing about its copies
    elsewhere, so what happens to it happens there only.
    """
    gens = sorted(generations, key=lambda g: g.name, reverse=True)
    ids_uncounted = frozenset(uncounted)
    ids_in_flight = frozenset(in_flight) | ids_uncounted
    abandoned = _abandoned(gens, floor)
    eligible = [g for g in gens if g.name not in abandoned]
    counted = [  # what takes a rule's place
        g
        for g in eligible
        if g.rejected is None and g.unvouched is None and g.generation_id not in ids_uncounted
    ]
    verdicts = _rule_verdicts(gens, counted, rules, now)
    kept = frozenset(name for name, verdict in verdicts.items() if verdict.keep)
    spared = _spared(eligible, rules, now)
    candidates = [g for g in eligible if g.mark is None]  # what a restore may take
    newest, fallback, blocked, needs = _safety_net(candidates)
    _keep_safety_net(verdicts, candidates, newest, fallback)
    validated = next((g for g in eligible if g.validated and g.rejected is None), None)
    if validated is not None:  # the one generation known to load and work: never pruned
        verdicts[validated.name].keep.insert(0, NEWEST_VALIDATED)
    for g in gens:
        _hold(verdicts[g.name], g, floor, ids_in_flight, blocked, now, g.name in spared)
    decisions = [_decide(g, verdicts[g.name], g.name in abandoned, delete_delay, now) for g in gens]
    if home is not None:
        rejected = {g.name for g in gens if g.rejected is not None}
        decisions = [replace(d, only_in=(home,)) if d.name in rejected else d for d in decisions]
    decisions += _finish_orphans(orphan_marks, floor, delete_delay, now)
    return RetentionPlan(
        now, decisions, newest, fallback, blocked, needs, kept if rules else frozenset()
    )


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


def _spared(
    eligible: list[GenerationFacts], rules: Sequence[RetentionRule], now: datetime
) -> set[GenerationName]:
    """The generations that fail the checks (or that another tier cannot vouch for)
    and that a rule would keep if they were sound: retention leaves them alone (in
    another tier a genuine copy may bear the name), though no rule counts them."""
    rejected = {g.name for g in eligible if g.rejected is not None or g.unvouched is not None}
    if not rejected:
        return set()
    inputs = [RuleInput(g.name, g.created, g.metrics) for g in eligible]
    return {name for rule in rules for name in rule.keeps(inputs, now) if name in rejected}


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
    spared: bool = False,
) -> None:
    """What keeps ``g`` whatever the rules say (a pin, the floor) and what defers its
    deletion (a rule would keep it were it sound, in flight, a reader's lease, a plan
    blocked on verification)."""
    if spared:
        verdict.defer.append(f"{REJECTED} ({g.rejected or g.unvouched})")
    if g.pinned:
        verdict.keep.append(PINNED)
    if floor is not None and floor.generation_id == g.generation_id:
        verdict.keep.append(FLOOR)
    if g.generation_id in ids_in_flight:
        verdict.defer.append(IN_FLIGHT)
    _defer_leased(verdict, g.lease_expiries, now)
    if blocked is not None and not verdict.keep:
        verdict.defer.append(blocked)


def _defer_leased(verdict: _Verdict, expiries: Iterable[datetime], now: datetime) -> None:
    leased = [until for until in expiries if until > now]
    if leased:
        verdict.defer.append(f"leased by a reader until {format_timestamp(max(leased))}")


def _finish_orphans(
    orphans: Iterable[OrphanMark], floor: RestoreFloor | None, delay: float, now: datetime
) -> list[Decision]:
    """Marks whose generation the planned store no longer lists, each in its own tier:
    kept (unmarked) for a pin or the floor, waiting for a lease or its delay, else its
    deletion is finished there."""
    decisions = []
    for orphan in sorted(orphans, key=lambda o: (o.name, o.tier), reverse=True):
        verdict = _Verdict()
        if orphan.pinned:
            verdict.keep.append(PINNED)
        if floor is not None and floor.generation_id == orphan.name.generation_id:
            verdict.keep.append(FLOOR)
        _defer_leased(verdict, orphan.lease_expiries, now)
        mark = orphan.mark
        delete_after = _after(mark.marked_at, delay)
        if verdict.keep:
            action, why = UNMARK, (*verdict.keep, *verdict.defer)
        elif verdict.defer or now < delete_after:
            action, why = MARKED, (mark.reason, *verdict.defer)
            if mark.undated and not verdict.defer:
                action, why = MARK, (mark.reason, REDATED)
        else:
            action, why = DELETE, (mark.reason, GONE)
        marked_at, after = (None, None) if verdict.keep else (mark.marked_at, delete_after)
        decisions.append(
            Decision(
                orphan.name,
                action,
                why,
                marked_at,
                after,
                listed=False,
                was_marked=True,
                only_in=(orphan.tier,),
            )
        )
    return decisions


def _after(moment: datetime, seconds: float) -> datetime:
    """``moment`` plus ``seconds``, saturating at the latest time a datetime holds."""
    try:
        return moment + timedelta(seconds=seconds)
    except OverflowError:
        return _LATEST


def _safety_net(
    candidates: list[GenerationFacts],
) -> tuple[GenerationName | None, GenerationName | None, str | None, GenerationName | None]:
    """(newest verified, fallback, why nothing may go yet, what to verify to settle it)."""
    newest_index = next((i for i, g in enumerate(candidates) if _verified(g) is True), None)
    if newest_index is None:
        unknown = next((g.name for g in candidates if _verified(g) is None), None)
        blocked = "no generation is known to verify yet" if candidates else None
        return None, None, blocked, unknown
    newest = candidates[newest_index].name
    older = candidates[newest_index + 1 :]
    for g in older:
        if _verified(g) is True:
            return newest, g.name, None, None
        if _verified(g) is None:
            return newest, None, "no older generation is known to verify yet (a fallback)", g.name
    if older:
        return newest, None, "no older generation verifies (a fallback is kept first)", None
    return newest, None, None, None


def _verified(g: GenerationFacts) -> bool | None:
    """What is known of ``g``'s verification: one failing the structure checks never does."""
    return False if g.rejected is not None else g.verified


def _decide(
    g: GenerationFacts, verdict: _Verdict, abandoned: bool, delay: float, now: datetime
) -> Decision:
    if verdict.keep:
        action = UNMARK if g.mark else KEEP
        return Decision(
            g.name, action, tuple(verdict.keep + verdict.defer), was_marked=bool(g.mark)
        )
    if g.mark is not None:
        delete_after = _after(g.mark.marked_at, delay)
        why = (g.mark.reason, *verdict.defer)
        action = MARKED if verdict.defer or now < delete_after else DELETE
        if action == MARKED and g.mark.undated and not verdict.defer:
            action, why = MARK, (g.mark.reason, REDATED)  # written again with now's time
        return Decision(g.name, action, why, g.mark.marked_at, delete_after, was_marked=True)
    if verdict.defer:
        return Decision(g.name, KEEP, tuple(verdict.defer))
    dropped = ABANDONED if abandoned else DROPPED
    return Decision(g.name, DELETE if delay == 0 else MARK, (dropped,), now, _after(now, delay))
