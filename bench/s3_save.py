"""S3 save throughput: ckptvault against a plain boto3 ``upload_file``, in one run.

    python -m bench.s3_save --size-gb 0.8 [--reps 3]

Starts an S3-protocol server (moto) on 127.0.0.1 in a separate process, builds a
model + AdamW state of about ``--size-gb`` GB, and, interleaved over ``--reps``
repetitions, measures:

- ``boto3 upload_file``: the same bytes, already in one local file (a safetensors
  file written before the clock starts), uploaded with boto3's managed transfer
  (multipart, 10 threads, its default chunking): what a hand-rolled uploader gets;
- ``ckptvault S3 save``: ``CheckpointManager("s3://...").save(...)`` of the live
  state: capture, hashing, multipart upload of the tensor files, manifest published
  last with a conditional PUT.

The loopback server is the bottleneck here, not a network: the figure that matters
is the ratio, which shows what ckptvault's format, hashing and publish protocol cost
on top of a plain upload. Medians and best runs are printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import boto3
from boto3.s3.transfer import TransferConfig
from safetensors.torch import save_file

import ckptvault as cv
from bench.save_restore import build, state_bytes, tensors_of

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@contextmanager
def moto_server() -> Iterator[str]:
    """An S3-protocol server in its own process (its own GIL), on loopback."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        yield endpoint
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=0.8)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    os.environ.update(CREDENTIALS)
    model, opt = build(args.size_gb)
    state = {"model": model, "optimizer": opt}
    nbytes = state_bytes(model, opt)
    work = Path(tempfile.mkdtemp(prefix="ckptvault-s3-bench-"))
    blob = work / "state.safetensors"
    save_file({k: v.contiguous() for k, v in tensors_of(model, opt).items()}, str(blob))
    seconds: dict[str, list[float]] = {"boto3 upload_file": [], "ckptvault S3 save": []}
    try:
        with moto_server() as endpoint:
            client = boto3.client("s3", endpoint_url=endpoint)
            client.create_bucket(Bucket="bench")
            transfer = TransferConfig(max_concurrency=10)
            for rep in range(args.reps):
                order = list(seconds) if rep % 2 == 0 else list(reversed(seconds))
                for name in order:
                    started = time.perf_counter()
                    if name == "boto3 upload_file":
                        client.upload_file(str(blob), "bench", f"plain/{rep}", Config=transfer)
                    else:
                        with cv.CheckpointManager(
                            f"s3://bench/run{rep}", run_id="bench", s3_endpoint_url=endpoint
                        ) as mgr:
                            mgr.save(rep, state)
                    seconds[name].append(time.perf_counter() - started)
                    print(f"rep {rep}: {name}: {seconds[name][-1]:.2f} s", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(seconds, nbytes)


def report(seconds: dict[str, list[float]], nbytes: int) -> None:
    reference = statistics.median(seconds["boto3 upload_file"])
    best_reference = min(seconds["boto3 upload_file"])
    print(
        f"\nS3 save of {nbytes / 1e9:.2f} GB to a loopback S3 server (moto), {len(seconds['boto3 upload_file'])} interleaved reps"
    )
    print(
        "| contender | median s | MB/s | x upload_file (median) | best s | x upload_file (best) |"
    )
    print("|---|---|---|---|---|---|")
    for name, runs in seconds.items():
        median, best = statistics.median(runs), min(runs)
        print(
            f"| {name} | {median:.2f} | {nbytes / median / 1e6:.0f} | {reference / median:.2f} "
            f"| {best:.2f} | {best_reference / best:.2f} |"
        )


if __name__ == "__main__":
    main()
