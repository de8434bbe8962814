"""Whether asynchronous saves' staging buffers fit in this host's memory, asked
before the first one is allocated.

An asynchronous save copies the state into a staging slot and returns; with
``max_in_flight=K`` there are K slots, each a full copy of what this rank saves
(pinned host memory for CUDA tensors, which cannot even be swapped). Too many of
them and the host swaps, or the OOM killer ends the job in the middle of a copy,
long after the line that asked for them. So ``prepare()`` and the first
asynchronous save compare what the slots will take with what is available
(:mod:`ckptvault.io.memory_available`) and raise :class:`HostMemoryError`, with
both numbers and what to do, before staging anything.

The estimate is per node: every rank of the node (``LOCAL_WORLD_SIZE``, which
torchrun sets) is taken to stage as much as this one at about the same time, as
the ranks of a data- or tensor-parallel job do. With ``async_mode="process"`` the
slots are files on a tmpfs (``/dev/shm``): they must fit in its free space as well
as in memory, since tmpfs pages are memory the kernel cannot drop.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ckptvault.errors import HostMemoryError
from ckptvault.io.memory_available import Available, available_memory, free_space
from ckptvault.io.staging import staged_source
from ckptvault.saving.shared_staging import SHM_DIR, layout_of

HOST_MEMORY, SHARED_MEMORY = "host-memory", "shared-memory"


def slot_bytes(tensors: Mapping[str, torch.Tensor], mode: str) -> int:
    """The bytes one staging slot takes for ``tensors`` (a DTensor: its local shard):
    plain buffers in ``"thread"`` mode, one aligned file in ``"process"`` mode."""
    local = {name: staged_source(tensor) for name, tensor in tensors.items()}
    if mode == "process":
        return layout_of(local)[1]
    return sum(t.numel() * t.element_size() for t in local.values())


def ranks_on_this_node() -> int:
    """How many ranks share this node's memory (torchrun's ``LOCAL_WORLD_SIZE``; 1
    when it is not set or not a positive number)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


@dataclass(frozen=True)
class StagingBudget:
    """What ``slots`` staging slots of ``per_slot`` bytes on each of ``ranks`` ranks
    need (``needed``), against what this host has (``memory``; ``shm_free`` for
    ``"process"`` mode, else None)."""

    per_slot: int
    slots: int
    ranks: int
    mode: str
    memory: Available | None
    shm_free: int | None
    shm_dir: Path = SHM_DIR

    @property
    def needed(self) -> int:
        return self.per_slot * self.slots * self.ranks

    def shortfall(self) -> tuple[str, int, str] | None:
        """``(reason, available bytes, which limit)`` when the slots do not fit."""
        if self.mode == "process" and self.shm_free is not None and self.needed > self.shm_free:
            return SHARED_MEMORY, self.shm_free, f"free space in {self.shm_dir}"
        if self.memory is not None and self.needed > self.memory.bytes:
            return HOST_MEMORY, self.memory.bytes, self.memory.limit
        return None

    def describe(self) -> str:
        """``2 slots x 3.0 GiB x 4 ranks on this node = 24.0 GiB``."""
        ranks = f" x {self.ranks} ranks on this node" if self.ranks > 1 else ""
        slots = "slot" if self.slots == 1 else "slots"
        return (
            f"{self.slots} staging {slots} (max_in_flight={self.slots}) x "
            f"{gib(self.per_slot)}{ranks} = {gib(self.needed)}"
        )


def staging_budget(
    per_slot: int, slots: int, mode: str, ranks: int | None = None, shm_dir: Path = SHM_DIR
) -> StagingBudget:
    """Read what this host has now for ``slots`` slots of ``per_slot`` bytes."""
    shm = free_space(shm_dir) if mode == "process" else None
    ranks = ranks_on_this_node() if ranks is None else ranks
    return StagingBudget(per_slot, slots, ranks, mode, available_memory(), shm, shm_dir)


def check_staging_fits(budget: StagingBudget, when: str) -> None:
    """Raise :class:`HostMemoryError` when ``budget``'s slots do not fit; ``when``
    says which call asked (``"prepare()"``, ``"the first asynchronous save"``)."""
    short = budget.shortfall()
    if short is None:
        return
    reason, available, limit = short
    if reason == SHARED_MEMORY:
        what_to_do = (
            f"enlarge {budget.shm_dir} (docker run --shm-size, or the tmpfs's size= option), "
            "lower max_in_flight, save synchronously (async_save=False), or use "
            "async_mode='thread'"
        )
    else:
        what_to_do = (
            "lower max_in_flight (each save in flight holds one staged copy), save "
            "synchronously (async_save=False or save(..., blocking=True)), or free host "
            "memory (fewer dataloader workers or less prefetch, a larger memory limit for "
            "the job)"
        )
    raise HostMemoryError(
        f"{when} refused: asynchronous saves need {budget.describe()} of "
        f"{'shared memory' if reason == SHARED_MEMORY else 'host memory'}, but only "
        f"{gib(available)} is available ({limit}). Nothing was staged or written. "
        f"To save: {what_to_do}",
        reason=reason,
        needed=budget.needed,
        available=available,
    )


def gib(nbytes: int) -> str:
    """Bytes as GiB (or MiB below one GiB), as memory is counted."""
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.1f} GiB"
    return f"{nbytes / 2**20:.1f} MiB"
