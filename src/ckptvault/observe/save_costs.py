"""What this run's saves cost before this process: the catalog's record, for
``cv.Planned`` to plan with from the start after a restart.

The catalog is control-plane state beside the ledger (never in the store); it is
read once, when a manager with a save policy starts on rank 0. A catalog that is
missing or cannot be read means nothing was measured yet, never an error: the
policy then starts from its assumed cost.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

from ckptvault.observe.catalog import Catalog

__all__ = ["measured_save_costs"]

logger = logging.getLogger("ckptvault")


def measured_save_costs(path: Path | None, store: str, run_id: str, limit: int = 5) -> list[float]:
    """Seconds the newest ``limit`` published saves of ``run_id`` into ``store``
    blocked training (their stall), newest first; empty without a catalog."""
    if path is None or not path.is_file():
        return []
    try:
        with Catalog(path) as catalog:
            records = catalog.recent_saves(store=store, run_id=run_id, limit=4 * limit)
    except Exception as exc:  # a record to plan with, never worth failing a run for
        logger.warning(
            "reading earlier save times from the catalog %s failed (%s: %s); the save "
            "policy starts as if nothing was measured",
            path,
            type(exc).__name__,
            exc,
        )
        return []
    costs = [
        r.stall_seconds
        for r in records
        if r.ok and math.isfinite(r.stall_seconds) and r.stall_seconds > 0
    ]
    return costs[:limit]
