"""Wall seconds per stage of one save or restore, for the events that report them.

Measuring must cost nothing next to the work measured: one ``time.perf_counter()``
call on each side of a phase, added into a plain dict. The stage names are the ones
the catalog and metrics read (``stage``, ``write``, ``fsync``, ``publish`` for saves;
``discovery``, ``verification``, ``read``, ``apply`` for restores). Time outside
every stage (capture, lock and lease bookkeeping) is in the total only, so the stages
never add up to more than it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class StageClock:
    """Accumulates seconds per stage name since it was made; one thread at a time."""

    def __init__(self, started: float | None = None) -> None:
        self.started = time.perf_counter() if started is None else started
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        """Count the wall time of the ``with`` body under ``name`` (raising or not)."""
        begun = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - begun)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + max(0.0, seconds)

    def elapsed(self) -> float:
        """Seconds since the clock started."""
        return time.perf_counter() - self.started

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)
