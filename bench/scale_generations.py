"""The generation-count axis: listing and restore discovery against the number of
generations in a POSIX store.

The measurement itself is :func:`bench.listing_scale.measure_listing` (``ls`` as a
user runs it and in-process, ``generations()``, the restore's candidate discovery,
a whole restore of the newest generation). Where that module is absent, a minimal
stand-in measures ``generations()`` and discovery only, and says so in its rows.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

import ckptvault as cv

STAND_IN = " (stand-in: bench/listing_scale.py is absent)"


def _best(fn: Callable[[], object], reps: int = 3) -> float:
    seconds = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return min(seconds)


def _stand_in(generations: int, root: Path) -> dict[str, float]:
    """``generations()`` and restore discovery on a store of tiny generations."""
    from ckptvault.restoring.selector import CandidateSelector

    store = root / f"store-{generations}"
    with cv.CheckpointManager(store, run_id="scale-listing", catalog=False) as manager:
        state = {"w": torch.zeros(4)}
        for step in range(len(manager.generations()), generations):
            manager.save(step, state)
        selector = CandidateSelector(manager.store, "scale-listing", manager.trust)
        return {
            "generations()" + STAND_IN: _best(manager.generations),
            "discovery" + STAND_IN: _best(selector.select),
        }


def measure_generations(generations: int, root: Path, keep: bool = False) -> dict[str, float]:
    """Operation -> best seconds on a store of ``generations`` generations built in a
    directory of its own under ``root`` (with its ledger; removed afterwards unless
    ``keep``, so that a later format is measured on stores it wrote)."""
    try:
        from bench.listing_scale import measure_listing
    except ImportError:
        measure_listing = _stand_in
    where = root / f"generations-{generations}"
    try:
        return measure_listing(generations, where)
    finally:
        if not keep:
            shutil.rmtree(where, ignore_errors=True)
