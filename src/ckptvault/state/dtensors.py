"""DTensors in a restore that runs in one process.

A job started with ``torchrun --nproc-per-node 1`` has a process group of one rank,
and FSDP2 (``fully_shard``) or ``distribute_tensor`` still turn its parameters into
DTensors on a mesh of that one rank. Such a restore applies the checkpoint itself (no
collective load), and what it decoded is whole tensors: a DTensor's ``copy_`` refuses
a plain tensor. On a mesh of one rank the one local shard of a ``Shard`` or
``Replicate`` placement is the whole tensor, so the saved tensor becomes the DTensor's
local part as it stands. A DTensor over more ranks cannot be written by one process:
that is a mismatch found while planning, before anything is applied.
"""

from __future__ import annotations

import sys

import torch


def is_dtensor(value: object) -> bool:
    """Whether ``value`` is a DTensor (without importing torch.distributed for it)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def in_live_layout(live: torch.Tensor, saved: torch.Tensor) -> torch.Tensor | str:
    """``saved`` (a whole tensor) in the layout of ``live``: itself for a plain
    ``live``; for a DTensor ``live`` on a mesh of one rank, a DTensor of the same mesh
    and placements whose local part is ``saved``. A string says why it cannot be,
    to be read after the entry's name."""
    if not is_dtensor(live) or is_dtensor(saved):
        return saved
    from torch.distributed.tensor import DTensor, Replicate, Shard

    assert isinstance(live, DTensor)
    ranks = live.device_mesh.size()
    if ranks != 1:
        return (
            f"is a DTensor over {ranks} ranks and this restore runs in one process: "
            "restore it on every rank of its mesh"
        )
    if not all(isinstance(placement, (Shard, Replicate)) for placement in live.placements):
        return (
            f"is a DTensor placed {tuple(live.placements)}: only Shard and Replicate "
            "placements can be written"
        )
    return DTensor.from_local(
        saved,
        live.device_mesh,
        live.placements,
        run_check=False,
        shape=live.shape,
        stride=saved.stride(),
    )
