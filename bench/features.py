"""Which of issue 27's optional ckptvault features this checkout has, so that a
benchmark measures them where they exist and still runs where they do not yet."""

from __future__ import annotations

import inspect

import ckptvault as cv


def process_mode_available() -> bool:
    """Whether ``CheckpointManager`` takes ``async_mode`` (the writer process)."""
    if "async_mode" in inspect.signature(cv.CheckpointManager).parameters:
        return True
    from ckptvault.assembly import ManagerOptions  # the options the manager accepts

    return "async_mode" in ManagerOptions.__annotations__


def in_place_available() -> bool:
    """Whether ``CheckpointManager.restore`` takes ``in_place`` (reading into the
    destination tensors)."""
    return "in_place" in inspect.signature(cv.CheckpointManager.restore).parameters
