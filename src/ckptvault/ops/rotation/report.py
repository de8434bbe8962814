"""What a key rotation did: one outcome per generation, and the report of one run of it.

:class:`RotationReport` is what :func:`ckptvault.ops.rotate.rotate_run_key` returns,
what ``ckptvault keys rotate --json`` prints, and what the ``key_rotated`` audit
entry counts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROTATED = "rotated"
ALREADY_ROTATED = "already-rotated"
SKIPPED = "skipped"
FAILED = "failed"
NOT_REACHED = "not-reached"  # stop_after ended the run first


@dataclass(frozen=True)
class GenerationOutcome:
    store: str
    step: int
    generation_id: str
    outcome: str  # one of the constants above
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "step": self.step,
            "generation_id": self.generation_id,
            "outcome": self.outcome,
            "detail": self.detail,
        }


@dataclass
class RotationReport:
    """What one call of :func:`~ckptvault.ops.rotate.rotate_run_key` did."""

    run_id: str
    keystore: str
    new_kek_id: str
    retired_kek_ids: list[str]
    resumed: bool  # an unfinished rotation was found and continued
    finished: bool = False  # the retired KEK was destroyed
    destroyed_kek_ids: list[str] = field(default_factory=list)
    generations: list[GenerationOutcome] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(1 for g in self.generations if g.outcome == outcome)

    def counts(self) -> dict[str, int]:
        return {
            name: self.count(name)
            for name in (ROTATED, ALREADY_ROTATED, SKIPPED, FAILED, NOT_REACHED)
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "keystore": self.keystore,
            "new_kek_id": self.new_kek_id,
            "retired_kek_ids": self.retired_kek_ids,
            "resumed": self.resumed,
            "finished": self.finished,
            "destroyed_kek_ids": self.destroyed_kek_ids,
            "counts": self.counts(),
            "generations": [g.to_json() for g in self.generations],
        }
