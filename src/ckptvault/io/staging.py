"""Staging buffers for asynchronous saves: one owned copy of every tensor, reused.

An asynchronous save must not write live tensors while training keeps mutating
them, so ``save`` first copies every tensor into a staging buffer and returns; the
background writer reads only the buffers. Buffers are keyed by the tensor's name,
shape and dtype and reused while the layout stays the same, so a steady-state save
allocates nothing and costs one memory copy. CUDA tensors are staged into pinned
host memory with non-blocking copies, synchronized once at the end.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

_Key = tuple[str, tuple[int, ...], torch.dtype]


class StagingSlot:
    """One set of buffers: holds one save's copy of the state."""

    def __init__(self) -> None:
        self._buffers: dict[_Key, torch.Tensor] = {}
        self.allocations = 0  # buffers created over the slot's life (tests and stats)

    def _buffer_for(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        key = (name, tuple(tensor.shape), tensor.dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            pin = tensor.device.type == "cuda" and torch.cuda.is_available()
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
            self._buffers[key] = buffer
            self.allocations += 1
        return buffer

    def stage(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Copy ``tensors`` into this slot's buffers; returns the staged copies."""
        live = {(name, tuple(t.shape), t.dtype) for name, t in tensors.items()}
        for stale in set(self._buffers) - live:  # the layout changed: free what is unused
            del self._buffers[stale]
        staged: dict[str, torch.Tensor] = {}
        cuda_used = False
        with torch.no_grad():
            for name, tensor in tensors.items():
                if isinstance(tensor, DTensor):  # stage the shard, keep the layout
                    local = tensor.to_local()
                    shard = self._buffer_for(name, local)
                    cuda_used |= _copy(shard, local)
                    staged[name] = DTensor.from_local(
                        shard,
                        tensor.device_mesh,
                        tensor.placements,
                        run_check=False,
                        shape=tensor.shape,
                        stride=tensor.stride(),
                    )
                    continue
                buffer = self._buffer_for(name, tensor)
                source = tensor.detach()
                if source.device.type == "cuda":
                    cuda_used = True
                    buffer.copy_(source, non_blocking=True)
                else:
                    buffer.copy_(source)
                staged[name] = buffer
        if cuda_used:
            torch.cuda.synchronize()
        return staged


def _copy(buffer: torch.Tensor, source: torch.Tensor) -> bool:
    """Copy ``source`` into ``buffer``; True when it came from a CUDA device (not yet
    synchronized)."""
    source = source.detach()
    if source.device.type == "cuda":
        buffer.copy_(source, non_blocking=True)
        return True
    buffer.copy_(source)
    return False


class StagingPool:
    """``slots`` reusable slots, handed out round-robin (one per save in flight)."""

    def __init__(self, slots: int) -> None:
        self.slots = [StagingSlot() for _ in range(max(1, slots))]
        self._next = 0

    def next_slot(self) -> StagingSlot:
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        return slot

    @property
    def allocations(self) -> int:
        return sum(slot.allocations for slot in self.slots)
