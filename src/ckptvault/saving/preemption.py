"""Preemption: a scheduler's signal becomes one final synchronous save and a clean exit.

Cluster schedulers announce preemption with a signal (SIGTERM, often SIGUSR1 a
few minutes ahead) and kill the job with SIGKILL after a grace period. A signal
handler must not save by itself: it runs between two bytecodes of the training
loop, in the middle of an optimizer step, when the state is inconsistent. So the
handler only records the request; the loop's next ``save()`` (the point where the
state is consistent by definition) finishes the save in flight, takes a final
synchronous save, and raises :class:`Preempted` — a ``SystemExit`` with code
:data:`ckptvault.exit_codes.PREEMPTED`, which ``ckptvault supervise`` restarts at
once. A loop that saves rarely checks ``mgr.preempted`` itself.

Publishing is atomic, so a save the deadline cuts short (or the SIGKILL after it)
publishes nothing: the newest complete generation stays the one to resume from.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable
from types import FrameType
from typing import Any

from ckptvault.errors import UsageError
from ckptvault.exit_codes import PREEMPTED

logger = logging.getLogger("ckptvault")

DEFAULT_DEADLINE_S = 120.0  # SLURM's default KillWait is 30 s, Kubernetes' grace 30 s

_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class Preempted(SystemExit):
    """Raised by ``save()`` after the final save of a preempted job: uncaught, the
    process exits with :data:`~ckptvault.exit_codes.PREEMPTED` (75) and no traceback.

    ``step`` is the step of that final save (``None`` when the deadline left no time
    for it: the job resumes from its newest earlier generation)."""

    def __init__(self, step: int | None, signal_name: str) -> None:
        super().__init__(PREEMPTED)
        self.step = step
        self.signal_name = signal_name

    def __str__(self) -> str:
        saved = f"saved step {self.step}" if self.step is not None else "no final save"
        return f"preempted by {self.signal_name}: {saved}; exit code {PREEMPTED} (restart)"


class PreemptionWatch:
    """Records that one of ``signals`` arrived; ``deadline_s`` is the time from the
    signal to the end of the final save that the scheduler allows.

    Handlers are installed at construction (which must run on the main thread, as
    Python requires) and the previous ones put back by :meth:`close`.
    """

    def __init__(self, signals: Iterable[int | signal.Signals], deadline_s: float) -> None:
        chosen = [signal.Signals(s) for s in signals]
        if not chosen:
            raise UsageError("save_on_signal needs at least one signal, e.g. (signal.SIGTERM,)")
        if not deadline_s > 0:
            raise UsageError(f"preemption_deadline_s must be > 0 seconds, got {deadline_s!r}")
        if threading.current_thread() is not threading.main_thread():
            raise UsageError(
                "save_on_signal installs signal handlers, which Python allows only on the "
                "main thread: create the CheckpointManager there"
            )
        self.deadline_s = float(deadline_s)
        self._event = threading.Event()
        self._received: tuple[str, float] | None = None  # signal name, monotonic time
        self._previous: dict[signal.Signals, _Handler] = {}
        for sig in chosen:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, number: int, frame: FrameType | None) -> None:
        # Only record: the loop is somewhere inside a step, its state inconsistent.
        if self._received is None:
            self._received = (signal.Signals(number).name, time.monotonic())
        self._event.set()

    def requested_elsewhere(self) -> None:
        """Another rank of the job got the signal: this one stops with it, and its
        deadline counts from now (the ranks' clocks are not comparable)."""
        if self._received is None:
            self._received = ("a signal to another rank", time.monotonic())
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    @property
    def signal_name(self) -> str:
        return self._received[0] if self._received else "none"

    def remaining(self) -> float:
        """Seconds left until the deadline (the full deadline before any signal)."""
        if self._received is None:
            return self.deadline_s
        return self.deadline_s - (time.monotonic() - self._received[1])

    def final_save(
        self,
        step: int,
        drain: Callable[[float], bool],
        save: Callable[[], object],
    ) -> Preempted:
        """Finish the save in flight (``drain``, bounded by the deadline), take the
        final synchronous ``save`` if time is left, and return the exception that
        ends the process. A save the deadline cuts short is abandoned: its staging
        area is never published."""
        if not drain(max(0.0, self.remaining())):
            logger.error(
                "preempted by %s: the save in flight did not finish within the deadline "
                "(%.0f s); it is abandoned unpublished, step %d is not saved",
                self.signal_name,
                self.deadline_s,
                step,
            )
            return Preempted(None, self.signal_name)
        if self.remaining() <= 0:
            logger.error("preempted by %s: no time left for a final save", self.signal_name)
            return Preempted(None, self.signal_name)
        save()
        logger.warning(
            "preempted by %s: saved step %d with %.1f s of the %.0f s deadline left; "
            "exiting with code %d (restart)",
            self.signal_name,
            step,
            self.remaining(),
            self.deadline_s,
            PREEMPTED,
        )
        return Preempted(step, self.signal_name)

    def close(self) -> None:
        """Put the previous handlers back (main thread only; elsewhere they stay)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
