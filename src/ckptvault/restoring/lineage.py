"""The lineage of a run: the run, step and generation it was warm-started from.

:mod:`ckptvault.restoring.warm_start` records it under :data:`LINEAGE` in the
contract of every manifest the new run writes; a restore of the new run reads it
back (:meth:`Lineage.from_contract`) so that the record survives restarts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

LINEAGE = "lineage"  # the key of the lineage in a manifest's contract
_MAX_FIELD = 1024  # a lineage read back from a manifest is carried only when small


@dataclass(frozen=True)
class Lineage:
    """Where a run started: the source run, its step and generation, and its store."""

    run_id: str
    step: int
    generation_id: str
    store: str

    def as_contract(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_contract(cls, contract: Any) -> Lineage | None:
        """The lineage a verified manifest's contract records, if well formed."""
        raw = contract.get(LINEAGE) if isinstance(contract, Mapping) else None
        if not isinstance(raw, Mapping) or set(raw) != {"run_id", "step", "generation_id", "store"}:
            return None
        texts = (raw["run_id"], raw["generation_id"], raw["store"])
        if not all(isinstance(t, str) and len(t) <= _MAX_FIELD for t in texts):
            return None
        if type(raw["step"]) is not int or raw["step"] < 0:
            return None
        return cls(raw["run_id"], raw["step"], raw["generation_id"], raw["store"])
