"""What a save tells whoever watches it write: a hang watchdog's progress.

A synchronous save that writes for minutes must not look like a hang to ``ckptvault
supervise --hang-timeout``, and a save whose storage stopped answering must. So a
:class:`~ckptvault.saving.generation_writer.GenerationWriter` tells its
:class:`SaveWatcher` when each save starts and ends, and every piece of tensor bytes
as it is written (about one call per MiB: a piece of a large tensor, or a buffer of
small ones). The manager's watcher is its
:class:`~ckptvault.observe.progress_reporter.ProgressReporter`.

Pieces are written by a save's writer threads, several at once, so a watcher must be
thread-safe, cheap (a counter and a clock read; whatever costs more, it throttles)
and must never raise: a save never fails for being watched.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

from ckptvault.progress import Progress


@runtime_checkable
class SaveWatcher(Protocol):
    """Told as saves run (see the module docstring); saves may overlap (a
    background save and a synchronous one waiting for it): ``save_ended`` comes
    once for each ``save_started``."""

    def save_started(self) -> None: ...

    def wrote(self, nbytes: int) -> None:
        """``nbytes`` more bytes of a save were written (any thread)."""

    def save_ended(self) -> None: ...


@contextmanager
def watched(watcher: SaveWatcher | None) -> Iterator[None]:
    """A save told to ``watcher`` (None: nobody watches): started on entry, ended on
    exit however it ends."""
    if watcher is None:
        yield
        return
    watcher.save_started()
    try:
        yield
    finally:
        watcher.save_ended()


def progress_of(watcher: SaveWatcher | None) -> Progress | None:
    """A ``progress(done, total)`` callback (:mod:`ckptvault.progress`) that tells
    ``watcher`` each increase of ``done``: bytes a save copies rather than writes (a
    memory tier's durable copy). None when nobody watches."""
    if watcher is None:
        return None
    told = 0

    def progress(done: int, total: int) -> None:
        nonlocal told
        if done > told:
            watcher.wrote(done - told)
            told = done

    return progress
