"""The progress bars every command draws for long work, on stderr.

A bar is drawn only where someone watches it: stderr is an interactive terminal
and the command does not print ``--json`` (stdout is then data, and whoever reads
it is a program). Anywhere else the callbacks cost a comparison and draw nothing,
so piped output and logs never fill with bar frames. A byte bar appears only once
the work is large enough to be worth one (a bar flashing for a few milliseconds
is noise); an item bar (generations, drills, decisions) appears at once.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TaskID,
    TextColumn,
    TransferSpeedColumn,
)

from ckptvault.cli._common import err

BYTES_THRESHOLD = 64 * 1024 * 1024  # show a byte bar only when the work is not instant
Unit = Literal["bytes", "items"]


class Bar:
    """A ``progress(done, total)`` callback (:mod:`ckptvault.progress`) drawing one
    transient bar; :meth:`describe` changes its label (the drill or step at work)."""

    def __init__(self, rich: Progress, what: str, unit: Unit) -> None:
        self._rich = rich
        self._what = what
        self._threshold = BYTES_THRESHOLD if unit == "bytes" else 1
        self._task: TaskID | None = None

    def __call__(self, done: int, total: int) -> None:
        if self._rich.disable:
            return
        if self._task is None and total >= self._threshold:
            self._task = self._rich.add_task(self._what, total=total)
        if self._task is not None:
            self._rich.update(self._task, completed=done, total=total)

    def describe(self, what: str) -> None:
        self._what = what
        if self._task is not None:
            self._rich.update(self._task, description=what)


def bars_enabled(as_json: bool = False) -> bool:
    """Whether a command draws bars: not with ``--json``, and only on a terminal."""
    return not as_json and err.is_interactive


@contextmanager
def progress_bar(what: str, unit: Unit = "bytes", *, as_json: bool = False) -> Iterator[Bar]:
    """A :class:`Bar` for the work inside the block, removed from the screen after it.
    ``what`` is rich markup: escape store-derived text (``safe_markup``)."""
    columns: tuple[ProgressColumn, ...]
    if unit == "bytes":
        columns = (DownloadColumn(), TransferSpeedColumn())
    else:
        columns = (MofNCompleteColumn(),)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        *columns,
        console=err,
        transient=True,
        disable=not bars_enabled(as_json),
    ) as rich:
        yield Bar(rich, what, unit)
