"""What a retention plan is made of: the facts about a generation, a deletion mark,
one decision per generation and the plan itself, and the names of actions and
reasons. The planner that fills them is :mod:`ckptvault.retention.plan`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ckptvault.format.layout import GenerationName, format_timestamp

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
REJECTED = (
    "fails the structure checks: no rule counts it, and retention leaves it alone while "
    "a rule would keep it were it sound"
)
REDATED = "its mark's time was unreadable or in the future: marked again now"
NEWEST_VALIDATED = "the newest validated generation (loaded into fresh objects and checked)"


@dataclass(frozen=True)
class Mark:
    """A deletion mark: when and why."""

    marked_at: datetime
    reason: str
    # Its recorded time was unreadable or in the future: it counts from now, and a pass
    # that keeps it marked writes it again with its own time (so it does expire).
    undated: bool = False


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
    rejected: str | None = None  # why it fails the structure checks, when it does
    # Why another tier the plan applies to cannot vouch for it (no copy there, or a copy
    # that fails the checks): no rule counts it, so it decides no deletion there.
    unvouched: str | None = None
    validated: bool = False  # loaded and checked by a validation (the catalog says so)

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
    listed: bool = True  # False: only its mark is left in the planned store (an orphan)
    was_marked: bool = False  # it carried a deletion mark when the plan was made
    # The locations of the tiers this decision is applied to; empty: every tier. An
    # orphan's names the one tier that carries its mark.
    only_in: tuple[str, ...] = ()

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
            "only_in": list(self.only_in),
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
    # The generations a rule keeps (each takes a rule's place): the collector checks
    # the structure of those it does not know, and plans again without the rejected.
    kept_by_rules: frozenset[GenerationName] = frozenset()

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


@dataclass(frozen=True)
class OrphanMark:
    """A deletion mark in tier ``tier`` (a store's location) whose generation the
    planned store does not list. Its deletion is finished in that tier alone."""

    name: GenerationName
    mark: Mark
    tier: str
    pinned: bool = False
    lease_expiries: tuple[datetime, ...] = ()
