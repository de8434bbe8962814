"""A save into an Azure Blob store that the test kills mid-upload (run as a script).

    python azure_crash_worker.py az://container/prefix

Saves step 1 (small) and prints ``saved 1``; then saves step 2, an 8 MiB tensor that
goes up as staged blocks of 1 MiB, one at a time, each block delayed by 0.25 s on the
client side (a slow link, as far as the service can tell), so that the test can
SIGKILL the process while blocks are staged and nothing is committed. The account
comes from ``AZURE_STORAGE_CONNECTION_STRING``, which the test sets.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any

import torch
from azure.storage.blob import BlobClient

import ckptvault as cv
from ckptvault.storage.azure.options import AzureOptions
from ckptvault.storage.azure.store import AzureStore

MiB = 1024 * 1024


def _slow_blocks() -> None:
    """Every staged block waits 0.25 s before it goes (the SDK's own call, wrapped)."""
    stage_block = BlobClient.stage_block

    @functools.wraps(stage_block)
    def slow(self: BlobClient, *args: Any, **kwargs: Any) -> Any:
        time.sleep(0.25)
        return stage_block(self, *args, **kwargs)

    BlobClient.stage_block = slow  # type: ignore[method-assign]


def main() -> None:
    store = AzureStore(sys.argv[1], AzureOptions(block_size=1 * MiB, max_concurrency=1))
    with cv.CheckpointManager(store, run_id="crash") as mgr:
        mgr.save(1, {"w": torch.arange(10.0)})
        print("saved 1", flush=True)
        _slow_blocks()
        mgr.save(2, {"w": torch.randn(2 * MiB)})
        print("saved 2", flush=True)


if __name__ == "__main__":
    main()
