"""Large host buffers: page-aligned anonymous mappings, huge pages where the kernel
offers them, and a way to fault them in before the time-critical copy.

Why not ``torch.empty``: a fresh allocation is faulted in page by page during the
first copy into it, which for an async save's staging buffers is inside the
training stall. A buffer from :func:`anonymous_buffer` asks for transparent huge
pages (``MADV_HUGEPAGE``: this matters where THP runs in ``madvise`` mode, the
common default, in which torch's allocator never gets them), and
:func:`fault_in` populates it on a background thread, so the stall is the copy
alone. Each buffer is its own mapping and goes back to the system (``munmap``)
when its last tensor view is freed.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os

import torch

HUGE_PAGE = 2 << 20  # smaller buffers cannot use a huge page: plain allocations
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not exported by Python's mmap module


def anonymous_buffer(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor of ``shape`` and ``dtype`` in its own anonymous
    mapping, with huge pages requested when it is large enough to use them."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * dtype.itemsize
    if nbytes < HUGE_PAGE:
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # THP disabled or unsupported: 4 KiB pages still work.
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE)
    # The tensor keeps the mapping alive; it is unmapped when the last view is freed.
    return torch.frombuffer(region, dtype=torch.uint8).view(dtype).reshape(shape)


def fault_in(buffer: torch.Tensor) -> None:
    """Make every page of ``buffer`` resident and writable now, so a later copy
    into it takes no page faults. Contents are unspecified afterwards."""
    if buffer.numel() == 0 or buffer.device.type != "cpu":
        return
    flat = buffer.reshape(-1).view(torch.uint8)
    if _populate(flat.data_ptr(), flat.numel()):
        return
    # Older kernels: write one byte per page (a huge page is faulted by its first).
    page = os.sysconf("SC_PAGE_SIZE")
    flat[::page].zero_()


def _populate(address: int, length: int) -> bool:
    """``madvise(MADV_POPULATE_WRITE)`` over the whole pages inside the range; False
    where the kernel or platform does not offer it."""
    page = os.sysconf("SC_PAGE_SIZE")
    start = address - address % page
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return False
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return bool(madvise(start, address + length - start, _MADV_POPULATE_WRITE) == 0)
