"""What one check of ``ckptvault doctor`` found: a status and what to do about it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"


@dataclass(frozen=True)
class Finding:
    check: str
    status: str  # ok, warn, fail, skip
    detail: str
    fix: str | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)
