"""Progress reports from long operations: one callback shape for all of them.

A long operation of the library (verifying a generation, exporting, consolidating,
copying a generation to another tier, applying a retention plan, rotating a run's
key) takes an optional ``progress(done, total)`` callback. ``done`` and ``total``
count bytes where the work is bytes and items (generations, decisions) otherwise;
``done`` never decreases and the last call has ``done == total`` once the work
finished. Calls come per chunk, file or item, never per byte: a callback may draw
a bar without slowing the work down.

A callback that raises stops the operation with :class:`ProgressCallbackError`
(never an ``OSError`` or a :class:`~ckptvault.errors.CheckpointError`), so that the
handlers that turn a bad file into a reported problem cannot mistake a broken
callback for a broken checkpoint and swallow it.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[int, int], None]  # (done, total): bytes or items


class ProgressCallbackError(RuntimeError):
    """A progress callback raised; the exception it raised is the ``__cause__``."""


def report(progress: Progress | None, done: int, total: int) -> None:
    """Call ``progress(done, total)``; its exception comes out as a
    :class:`ProgressCallbackError` (a ``KeyboardInterrupt`` passes through as is)."""
    if progress is None:
        return
    try:
        progress(done, total)
    except ProgressCallbackError:
        raise
    except Exception as exc:
        raise ProgressCallbackError(
            f"the progress callback raised {type(exc).__name__}: {exc}"
        ) from exc


class Meter:
    """Counts work as it is done and reports the running total to ``progress``.

    ``meter(n)`` adds ``n`` (bytes or items) and reports; ``meter.finish()`` reports
    ``done == total`` when the work is over (a file that could not be read still
    counts as gone through). ``Meter(None, total)`` does nothing, cheaply."""

    def __init__(self, progress: Progress | None, total: int) -> None:
        self.progress = progress
        self.total = max(total, 0)
        self.done = 0
        report(progress, 0, self.total)

    def __call__(self, count: int) -> None:
        if self.progress is None or count <= 0:
            return
        self.done = min(self.done + count, self.total)
        report(self.progress, self.done, self.total)

    def finish(self) -> None:
        if self.progress is not None and self.done < self.total:
            self.done = self.total
            report(self.progress, self.done, self.total)
