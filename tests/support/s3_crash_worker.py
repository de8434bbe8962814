"""A save into an S3 store that the test kills mid-upload (run as a script).

    python s3_crash_worker.py s3://bucket/prefix

Saves step 1 (small) and prints ``saved 1``; then saves step 2, a 40 MiB tensor that
goes up as a multipart upload of 5 MiB parts, one at a time, each part delayed by
0.25 s on the client side (a real slow link, as far as the server can tell), so
that the test can SIGKILL the process while the upload is half done. Endpoint and
credentials come from the environment the test sets.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

import ckptvault as cv

MiB = 1024 * 1024


def _slow_part(**_kwargs: Any) -> None:
    time.sleep(0.25)


def main() -> None:
    with cv.CheckpointManager(
        sys.argv[1], run_id="crash", s3_part_size=5 * MiB, s3_max_concurrency=1
    ) as mgr:
        mgr.save(1, {"w": torch.arange(10.0)})
        print("saved 1", flush=True)
        client = mgr.store.client.raw  # type: ignore[attr-defined]  # an S3Store
        client.meta.events.register("before-call.s3.UploadPart", _slow_part)
        mgr.save(2, {"w": torch.randn(10 * MiB)})
        print("saved 2", flush=True)


if __name__ == "__main__":
    main()
