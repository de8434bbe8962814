"""Where a file's verified bytes go: byte ranges of it and their destinations.

The reader plans, for each tensor file, the :class:`Target` s its chunks fill and
streams verified bytes into them through a :class:`Scatter`; both read paths
(:mod:`ckptvault.io.reader`'s streamed one and :mod:`ckptvault.io.direct_read`)
share them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Target:
    """A byte range of a file and where its verified bytes go."""

    start: int
    end: int
    buffer: torch.Tensor  # flat uint8 destination, (end - start) bytes
    finish: Callable[[], None] = lambda: None
    direct: bool = False  # the buffer is the destination tensor's own memory


@dataclass
class FilePlan:
    targets: list[Target] = field(default_factory=list)


class Scatter:
    """Copies a stream of (offset, bytes) pieces into the targets they overlap."""

    def __init__(self, targets: list[Target]) -> None:
        self.targets = sorted(targets, key=lambda t: t.start)
        self._first = 0  # the first target that may still receive bytes

    def put(self, offset: int, data: torch.Tensor) -> None:
        """Copy ``data``, the file's bytes from ``offset`` on, into every target it
        overlaps (targets are put in file order, so each put starts where the last
        one left off)."""
        end = offset + data.numel()
        targets = self.targets
        while self._first < len(targets) and targets[self._first].end <= offset:
            self._first += 1
        index = self._first
        destinations: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        while index < len(targets) and targets[index].start < end:
            target = targets[index]
            lo, hi = max(target.start, offset), min(target.end, end)
            if hi > lo:
                whole = lo == target.start and hi == target.end
                destinations.append(
                    target.buffer if whole else target.buffer[lo - target.start : hi - target.start]
                )
                sources.append(data[lo - offset : hi - offset])
            index += 1
        copy_all(destinations, sources)


def copy_all(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair; many small tensors in one call, which costs a
    fraction of a Python-level call per tensor."""
    if len(destinations) > 1:
        torch._foreach_copy_(destinations, sources)
    elif destinations:
        destinations[0].copy_(sources[0])
