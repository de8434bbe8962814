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
    """Where a run started: the source run, its step and generation, and its store;
    for Hugging Face weights (no run, step 0), ``files``: each file read and its
    BLAKE3 digest, ``[name, hex]``."""

    run_id: str
    step: int
    generation_id: str
    store: str
    files: tuple[tuple[str, str], ...] = ()

    def as_contract(self) -> dict[str, Any]:
        record = asdict(self)
        if self.files:
            record["files"] = [list(pair) for pair in self.files]
        else:
            del record["files"]
        return record

    @classmethod
    def from_contract(cls, contract: Any) -> Lineage | None:
        """The lineage a verified manifest's contract records, if well formed."""
        raw = contract.get(LINEAGE) if isinstance(contract, Mapping) else None
        if not isinstance(raw, Mapping) or set(raw) - {"files"} != _FIELDS:
            return None
        texts = (raw["run_id"], raw["generation_id"], raw["store"])
        if not all(isinstance(t, str) and len(t) <= _MAX_FIELD for t in texts):
            return None
        if type(raw["step"]) is not int or raw["step"] < 0:
            return None
        files = _files(raw.get("files", []))
        if files is None:
            return None
        return cls(raw["run_id"], raw["step"], raw["generation_id"], raw["store"], files)


_FIELDS = {"run_id", "step", "generation_id", "store"}
_MAX_FILES = 10_000


def _files(raw: Any) -> tuple[tuple[str, str], ...] | None:
    """``[[name, digest], ...]`` read back, or None where malformed or too large."""
    if not isinstance(raw, list) or len(raw) > _MAX_FILES:
        return None
    pairs = []
    for pair in raw:
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and all(isinstance(t, str) and len(t) <= _MAX_FIELD for t in pair)
        ):
            return None
        pairs.append((pair[0], pair[1]))
    return tuple(pairs)
