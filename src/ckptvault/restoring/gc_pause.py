"""Pausing Python's cyclic garbage collector while a restore runs.

A restore allocates tens of thousands of containers (the manifest's JSON, the tensor
file headers, one tensor object per entry) that all live until it ends. Every full
collection they set off walks every object of the process, the caller's whole state
included, and frees nothing: at 10,000 tensors, two full collections were 40 % of the
restore. ``torch.distributed.checkpoint.state_dict`` pauses the collector around its
own work for the same reason.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Pause the cyclic collector for the ``with`` body, then resume it; reference
    counting still frees everything as usual. A collector the caller paused stays
    paused. (Pausing is process-wide: another thread's cyclic garbage waits for the
    body to end, which bounds it by one restore's duration.)"""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
