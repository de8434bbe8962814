"""Staging buffers for asynchronous saves: one owned copy of every tensor, reused.

An asynchronous save must not write live tensors while training keeps mutating
them, so ``save`` first copies every tensor into a staging buffer and returns; the
background writer reads only the buffers. Buffers are keyed by the tensor's name,
shape and dtype and reused while the layout stays the same, so a steady-state save
allocates nothing and costs one memory copy. CUDA tensors are staged into pinned
host memory with non-blocking copies, synchronized once at the end.

The first save would also fault its fresh buffers in, inside the stall.
:meth:`StagingPool.prepare` takes that off the critical path: given the layout
ahead of time (``CheckpointManager.prepare``), it allocates every slot's buffers
as huge-page mappings (:mod:`ckptvault.io.host_memory`) and faults them in on a
background thread, so even the first stall is one copy.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from ckptvault.io.host_memory import anonymous_buffer, fault_in

_Key = tuple[str, tuple[int, ...], torch.dtype]


def staged_source(tensor: torch.Tensor) -> torch.Tensor:
    """What a staging buffer holds a copy of: a DTensor's local shard, else the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class StagingSlot:
    """One set of buffers: holds one save's copy of the state."""

    def __init__(self) -> None:
        self._buffers: dict[_Key, torch.Tensor] = {}
        self.allocations = 0  # buffers created over the slot's life (tests and stats)

    def _buffer_for(self, name: str, tensor: torch.Tensor, prefault: bool = False) -> torch.Tensor:
        key = (name, tuple(tensor.shape), tensor.dtype)
        buffer = self._buffers.get(key)
        if buffer is None:
            if tensor.device.type == "cuda" and torch.cuda.is_available():
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            elif prefault:
                buffer = anonymous_buffer(tuple(tensor.shape), tensor.dtype)
                fault_in(buffer)
            else:
                # Inside the stall: plain pages. A fresh huge-page mapping can fault
                # in slower than reused 4 KiB pages (measured on a VM whose balloon
                # returns freed high-order memory to the host).
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype)
            self._buffers[key] = buffer
            self.allocations += 1
        return buffer

    def reserve(self, tensors: Mapping[str, torch.Tensor], cancel: threading.Event) -> None:
        """Allocate and fault in buffers for ``tensors`` (read for names, shapes and
        dtypes only); stops early when ``cancel`` is set."""
        for name, tensor in tensors.items():
            if cancel.is_set():
                return
            self._buffer_for(name, staged_source(tensor), prefault=True)

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
        self._preparing: threading.Thread | None = None
        self._cancel = threading.Event()

    def prepare(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Start allocating and faulting in every slot's buffers for ``tensors`` on a
        background thread; returns at once. The next :meth:`next_slot` waits for it."""
        self.finish_preparing()
        layout = {name: staged_source(t) for name, t in tensors.items()}

        def reserve_all() -> None:
            for slot in self.slots:
                slot.reserve(layout, self._cancel)

        self._preparing = threading.Thread(
            target=reserve_all, name="ckptvault-staging-prepare", daemon=True
        )
        self._preparing.start()

    def finish_preparing(self, cancel: bool = False) -> None:
        """Wait for a :meth:`prepare` in progress (stopping it early with ``cancel``)."""
        if self._preparing is None:
            return
        if cancel:
            self._cancel.set()
        self._preparing.join()
        self._preparing = None
        self._cancel.clear()

    def next_slot(self) -> StagingSlot:
        self.finish_preparing()  # its buffers are this save's; never stage beside it
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        return slot

    @property
    def allocations(self) -> int:
        return sum(slot.allocations for slot in self.slots)
