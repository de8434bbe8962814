"""ckptvault: fast, crash-proof, verifiable PyTorch training checkpoints.

Public names::

    CheckpointManager, RNGState, PerRank, RestoreInfo, SaveHandle, GenerationInfo,
    SkippedGeneration, Retention, MemoryTier, errors, __version__
    Every, Planned, Any (save policies: CheckpointManager(save_policy=...))

Names that need torch are imported on first use, so ``ckptvault.errors`` and the
command-line tools for listing and verifying stores start without importing torch.
"""

from __future__ import annotations

import typing
from typing import TYPE_CHECKING

from ckptvault import _moved, errors
from ckptvault._version import __version__

_moved.install()  # modules that moved stay importable under their old paths

if TYPE_CHECKING:
    from ckptvault.manager import (
        CheckpointManager,
        RestoreInfo,
        SkippedGeneration,
    )
    from ckptvault.memory.tier import MemoryTier
    from ckptvault.retention.policy import Retention
    from ckptvault.saving.handles import SaveHandle, SaveStats
    from ckptvault.saving.policy import Any, Every, Planned
    from ckptvault.saving.preemption import Preempted
    from ckptvault.state.ranks import PerRank
    from ckptvault.state.rng import RNGState
    from ckptvault.storage.listing import GenerationInfo

_LAZY = {
    "Any": "ckptvault.saving.policy",
    "Every": "ckptvault.saving.policy",
    "Planned": "ckptvault.saving.policy",
    "CheckpointManager": "ckptvault.manager",
    "GenerationInfo": "ckptvault.storage.listing",
    "MemoryTier": "ckptvault.memory.tier",
    "RestoreInfo": "ckptvault.manager",
    "Retention": "ckptvault.retention.policy",
    "SaveHandle": "ckptvault.saving.handles",
    "SaveStats": "ckptvault.saving.handles",
    "SkippedGeneration": "ckptvault.manager",
    "RNGState": "ckptvault.state.rng",
    "PerRank": "ckptvault.state.ranks",
    "Preempted": "ckptvault.saving.preemption",
}

__all__ = [
    "Any",
    "CheckpointManager",
    "Every",
    "GenerationInfo",
    "MemoryTier",
    "PerRank",
    "Planned",
    "Preempted",
    "RNGState",
    "RestoreInfo",
    "Retention",
    "SaveHandle",
    "SaveStats",
    "SkippedGeneration",
    "__version__",
    "errors",
]


def __getattr__(name: str) -> typing.Any:  # cv.Any is a save policy
    if name == "dcp":  # the DCP storage plugin (needs torch), a subpackage
        import importlib

        return importlib.import_module("ckptvault.dcp")
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'ckptvault' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
