"""Bounded parallel uploads of an object store's parts (S3 parts, Azure blocks).

A store's writable files hand each full buffer to its :class:`PartUploader`, which
runs at most ``max_concurrency`` uploads at once for the whole store and makes
writers wait for a free slot: a save then holds at most that many parts in flight
plus one filling buffer per open file, however large the checkpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class PartUploader:
    """The store's upload threads: at most ``max_concurrency`` parts in flight."""

    def __init__(self, max_concurrency: int) -> None:
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._pool = ThreadPoolExecutor(max_concurrency, thread_name_prefix="ckptvault-upload")

    def submit(self, upload: Callable[[], dict[str, Any]]) -> Future[dict[str, Any]]:
        """Run ``upload`` on a pool thread; blocks while every slot is taken (that
        wait is the backpressure that bounds memory)."""
        self._slots.acquire()
        try:
            future = self._pool.submit(upload)
        except BaseException:
            self._slots.release()
            raise
        future.add_done_callback(lambda _done: self._slots.release())
        return future
