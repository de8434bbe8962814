"""``SaveHandle``: the outcome of one ``save``, synchronous or in the background.

A background save's error is never lost: ``result()`` raises it, and the manager
raises it again from the next ``save()``, ``wait()`` or ``close()`` unless it was
already raised once (``reported``).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass

from ckptvault.storage.listing import GenerationInfo


@dataclass
class SaveStats:
    """Counters a training loop (or a metrics exporter) can read from ``mgr.stats``."""

    saves_started: int = 0
    saves_completed: int = 0
    saves_failed: int = 0
    saves_skipped: int = 0
    bytes_written: int = 0
    last_stall_seconds: float = 0.0
    last_save_seconds: float = 0.0
    staging_allocations: int = 0
    plans_reused: int = 0
    replica_mismatches: int = 0  # many ranks: replicated tensor slots that differed


class SaveHandle:
    """Done when returned for synchronous saves; for asynchronous ones, once published."""

    def __init__(
        self,
        step: int,
        future: Future[GenerationInfo | None] | None,
        stall_seconds: float,
        skipped: bool = False,
    ) -> None:
        self.step = step
        self.future = future
        self.stall_seconds = stall_seconds
        self.skipped = skipped
        self.reported = False

    @classmethod
    def completed(cls, info: GenerationInfo, seconds: float) -> SaveHandle:
        future: Future[GenerationInfo | None] = Future()
        future.set_result(info)
        return cls(info.step, future, seconds)

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def failed(self) -> bool:
        return (
            self.future is not None and self.future.done() and self.future.exception() is not None
        )

    def result(self, timeout: float | None = None) -> GenerationInfo | None:
        """The published generation (None for a skipped save); raises the save's error."""
        if self.future is None:
            return None
        try:
            return self.future.result(timeout)
        except BaseException:
            self.reported = True
            raise

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return None if self.future is None else self.future.exception(timeout)

    def __repr__(self) -> str:
        state = "skipped" if self.skipped else ("done" if self.done() else "in flight")
        return f"SaveHandle(step={self.step}, {state})"
