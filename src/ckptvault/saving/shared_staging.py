"""Staging in shared memory, for the writer process (``async_mode="process"``).

An asynchronous save copies the state into a staging slot and returns; the writer
process reads the slot. Each slot is one file under ``/dev/shm`` (tmpfs: memory,
never a disk), mapped by both processes, holding every tensor at a 64-byte aligned
offset. What the writer process needs to find them is the slot's **layout**: its
path and, per tensor, name, dtype, shape and offset, sent as JSON (never pickle).

The layout is kept while names, shapes and dtypes stay the same, so a steady-state
save allocates nothing and costs one memory copy, as the thread mode's staging
(:mod:`ckptvault.io.staging`). A changed layout makes a new file (a new path: the
writer process maps it afresh) and unlinks the old one. Files are private to the
user (0600), named after this process's id, and removed by :meth:`close`, by a
finalizer, or by the writer process when this process is gone.

On a machine with CUDA a slot is registered as pinned memory with the CUDA driver,
so device-to-host copies run at full speed into it.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ckptvault.errors import StorageFullError, UsageError
from ckptvault.io.dcp_metadata import dtype_from_name

ALIGN = 64
SHM_DIR = Path("/dev/shm")
PREFIX = "ckptvault-stage-"


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str  # torch's name without "torch.", e.g. "float32"
    shape: tuple[int, ...]  # a DTensor's: its local shard's
    offset: int
    nbytes: int

    def to_json(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape), self.offset, self.nbytes]


def dtensor_spec(tensor: DTensor) -> dict[str, Any]:
    """What the writer process needs to see a staged shard as the DTensor it is part
    of: the mesh (its shape, ranks and names), the placements, the global shape and
    stride. Shard and Replicate placements only (a Partial sum is not a state)."""
    placements: list[list[Any]] = []
    for placement in tensor.placements:
        if isinstance(placement, Shard):
            placements.append(["shard", placement.dim])
        elif isinstance(placement, Replicate):
            placements.append(["replicate"])
        else:
            raise UsageError(
                f"async_mode='process' saves Shard and Replicate DTensors; one is {placement} "
                "(a pending reduction). Use async_mode='thread'"
            )
    mesh = tensor.device_mesh
    return {
        "mesh": {
            "shape": list(mesh.mesh.shape),
            "ranks": mesh.mesh.flatten().tolist(),
            "names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        },
        "placements": placements,
        "shape": list(tensor.shape),
        "stride": list(tensor.stride()),
    }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def layout_of(tensors: Mapping[str, torch.Tensor]) -> tuple[list[Entry], int]:
    """Each tensor's place in a slot (aligned, in the mapping's order) and the size."""
    entries, offset = [], 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        entries.append(Entry(name, dtype_name(tensor.dtype), tuple(tensor.shape), offset, nbytes))
        offset += math.ceil(max(nbytes, 1) / ALIGN) * ALIGN
    return entries, max(offset, ALIGN)


def views(buffer: torch.Tensor, entries: list[Entry]) -> dict[str, torch.Tensor]:
    """The tensors a slot holds, as views of its bytes (``buffer``: uint8)."""
    out = {}
    for entry in entries:
        raw = buffer[entry.offset : entry.offset + entry.nbytes]
        dtype = dtype_from_name(entry.dtype, f"staging slot entry {entry.name!r}")
        out[entry.name] = raw.view(dtype).view(entry.shape)
    return out


def map_file(path: str, size: int) -> torch.Tensor:
    """A slot file mapped shared (writes visible to every process mapping it)."""
    return torch.from_file(path, shared=True, size=size, dtype=torch.uint8)


class SharedSlot:
    """One staging file: holds one save's copy of the state."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.path: str | None = None
        self.entries: list[Entry] = []
        self.size = 0
        self._buffer: torch.Tensor | None = None
        self._key: tuple[Any, ...] | None = None
        self.allocations = 0

    def _ensure(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """A file laid out for ``tensors`` (plain tensors: DTensors' local shards)."""
        key = tuple((n, tuple(t.shape), t.dtype) for n, t in tensors.items())
        # A file someone removed (a forked child's exit, a cleaner) is made anew.
        if key == self._key and self._buffer is not None and os.path.exists(str(self.path)):
            return
        entries, size = layout_of(tensors)
        self.release()
        _check_room(self.directory, size)
        path = self.directory / f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            # Reserved, not sparse: a tmpfs filled later gives ENOSPC here, never
            # SIGBUS in the middle of a copy.
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            os.close(fd)
            _unlink(str(path))
            raise StorageFullError(
                f"a staging slot of {size / 2**20:.1f} MiB could not be reserved in "
                f"{self.directory} ({exc.strerror}): free space there, lower max_in_flight, or "
                "use async_mode='thread'"
            ) from exc
        os.close(fd)
        self._buffer = map_file(str(path), size)
        _pin(self._buffer)
        self.path, self.entries, self.size, self._key = str(path), entries, size, key
        self.allocations += 1

    def stage(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """Copy ``tensors`` (a DTensor: its local shard) into this slot; returns its
        layout as JSON for the writer process (DTensors' specs under "dtensors")."""
        local = {name: _local(t) for name, t in tensors.items()}
        specs = {name: dtensor_spec(t) for name, t in tensors.items() if isinstance(t, DTensor)}
        self._ensure(local)
        assert self._buffer is not None
        cuda_used = False
        with torch.no_grad():
            for entry, (name, tensor) in zip(self.entries, local.items(), strict=True):
                target = views(self._buffer, [entry])[name]
                source = tensor.detach()
                cuda_used |= source.device.type == "cuda"
                target.copy_(source, non_blocking=source.device.type == "cuda")
        if cuda_used:
            torch.cuda.synchronize()
        return {
            "path": self.path,
            "size": self.size,
            "tensors": [e.to_json() for e in self.entries],
            "dtensors": specs,
        }

    def release(self) -> None:
        """Unmap (drop this process's view) and unlink the file."""
        if self._buffer is not None:
            _unpin(self._buffer)
        self._buffer, self._key = None, None
        if self.path is not None:
            _unlink(self.path)
            self.path = None


class SharedStagingPool:
    """``slots`` slots handed out round-robin (one per save in flight)."""

    def __init__(self, slots: int, directory: Path = SHM_DIR) -> None:
        if not directory.is_dir():
            raise UsageError(
                f"async_mode='process' stages in shared memory under {directory}, which does "
                "not exist here; use async_mode='thread'"
            )
        sweep_dead(directory)
        self.slots = [SharedSlot(directory) for _ in range(max(1, slots))]
        self._next = 0
        # Only this process removes its slots: a forked child inherits the finalizer.
        self._finalizer = weakref.finalize(self, _release_all, self.slots, os.getpid())

    def next_slot(self) -> SharedSlot:
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        return slot

    def prepare(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Allocate and fault in every slot for ``tensors``' layout now."""
        local = {name: _local(t) for name, t in tensors.items()}
        for slot in self.slots:
            slot._ensure(local)
            assert slot._buffer is not None
            slot._buffer.zero_()  # faults every page in

    @property
    def allocations(self) -> int:
        return sum(slot.allocations for slot in self.slots)

    def close(self) -> None:
        self._finalizer()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def stale_files(pid: int, directory: Path = SHM_DIR) -> list[Path]:
    """The slot files of process ``pid`` (the writer process removes them when that
    process is gone)."""
    return sorted(directory.glob(f"{PREFIX}{pid}-*"))


def _release_all(slots: list[SharedSlot], owner: int) -> None:
    if os.getpid() != owner:
        return
    for slot in slots:
        slot.release()


def sweep_dead(directory: Path = SHM_DIR) -> list[Path]:
    """Remove this user's slot files whose process is gone (a trainer killed with its
    writer leaves them, holding memory until reboot); the files removed. A pid reused
    by a live process keeps its files: better a leak than a live save's slot."""
    removed = []
    for path in directory.glob(f"{PREFIX}*"):
        try:
            pid = int(path.name[len(PREFIX) :].split("-", 1)[0])
            if path.lstat().st_uid != os.getuid() or _alive(pid):
                continue
            path.unlink()
            removed.append(path)
        except (ValueError, OSError):
            continue
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _check_room(directory: Path, size: int) -> None:
    """Refuse a slot that the tmpfs cannot hold, rather than dying of SIGBUS later."""
    info = os.statvfs(directory)
    free = info.f_bavail * info.f_frsize
    if size > free:
        raise StorageFullError(
            f"a staging slot of {size / 2**20:.1f} MiB does not fit in {directory} "
            f"({free / 2**20:.1f} MiB free): async_mode='process' stages every save in flight "
            "in shared memory. Free space there, lower max_in_flight, or use "
            "async_mode='thread'"
        )


def _pin(buffer: torch.Tensor) -> None:
    """Register the slot as pinned host memory where CUDA is available (fast D2H)."""
    if not torch.cuda.is_available():
        return
    cudart = torch.cuda.cudart()
    cudart.cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)


def _unpin(buffer: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
