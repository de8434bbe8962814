"""Listing at scale: ``ls``, ``generations()`` and restore discovery against the
number of generations in a store.

    python -m bench.listing_scale [--generations 10 100 1000] [--reps 3] [--s3] [--dir D]

For each generation count, builds a store of that many tiny generations (real saves
of a four-float state, with a ledger outside the store, as a trusted run has) and
measures, best of ``--reps``:

- ``ls (subprocess)``: ``python -m ckptvault ls STORE`` as a user runs it (interpreter
  start and imports included);
- ``ls``, ``ls --json``, ``ls --all``: the CLI in-process (``ckptvault.cli.main``);
- ``generations()``: ``CheckpointManager.generations()``;
- ``discovery``: the restore's candidate selection (listing, marks, ledger);
- ``restore``: a whole restore of the newest generation (discovery, verification of
  that one generation, apply).

With ``--s3`` the same stores are copied into a loopback S3 server (moto, in its own
process) key for key, and ``ls``, ``generations()``, discovery and restore are timed
there too. The store is a directory ``store-<N>`` under ``--dir``, reused when it
already holds N generations. Prints a Markdown table; times are seconds.
:func:`measure_listing` is the entry point other benchmarks import.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

import ckptvault as cv
from ckptvault.cli import main as cli_main
from ckptvault.restoring.selector import CandidateSelector
from ckptvault.storage import open_store

RUN_ID = "listing-bench"
COUNTS = (10, 100, 1000)


def _state() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(4)}


def _manager(location: str, root: Path) -> cv.CheckpointManager:
    """A manager with the store's own ledger and audit log beside (never inside) it."""
    slug = "".join(c if c.isalnum() else "_" for c in location)
    return cv.CheckpointManager(
        location,
        run_id=RUN_ID,
        ledger=root / f"ledger-{slug}.sqlite3",
        audit_log=root / f"audit-{slug}.jsonl",
        catalog=False,
        metrics=False,
    )


def build_store(root: Path, generations: int) -> Path:
    """``root/store-<N>`` holding ``generations`` published generations (reused when
    it already does)."""
    store = root / f"store-{generations}"
    if store.is_dir() and len(open_store(store).list_generations()) == generations:
        return store
    root.mkdir(parents=True, exist_ok=True)
    with _manager(str(store), root) as manager:
        state = _state()
        for step in range(len(manager.generations()), generations):
            manager.save(step, state)
    return store


def best(fn: Callable[[], object], reps: int) -> float:
    seconds = []
    for _ in range(reps):
        started = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - started)
    return min(seconds)


def _ls(location: str, *flags: str) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        status = cli_main(["ls", location, *flags])
    if status:
        raise RuntimeError(f"ckptvault ls {location} exited {status}")


def _ls_subprocess(location: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "ckptvault", "ls", location],
        check=True,
        stdout=subprocess.DEVNULL,
        timeout=120,
    )


def _timings(location: str, root: Path, reps: int, subprocess_too: bool) -> dict[str, float]:
    figures: dict[str, float] = {}
    if subprocess_too:
        figures["ls (subprocess)"] = best(lambda: _ls_subprocess(location), reps)
    figures["ls"] = best(lambda: _ls(location), reps)
    figures["ls --json"] = best(lambda: _ls(location, "--json"), reps)
    figures["ls --all"] = best(lambda: _ls(location, "--all"), reps)
    with _manager(location, root) as manager:
        figures["generations()"] = best(manager.generations, reps)
        selector = CandidateSelector(manager.store, RUN_ID, manager.trust)
        figures["discovery"] = best(selector.select, reps)
        state = _state()
        figures["restore"] = best(lambda: manager.restore(state), reps)
    return figures


def measure_listing(generations: int, root: Path) -> dict[str, float]:
    """Best-of-3 seconds of ``ls`` (subprocess, in-process, ``--json``, ``--all``),
    ``generations()``, restore discovery and a whole restore on a POSIX store of
    ``generations`` tiny generations, built under ``root`` (reused when present)."""
    store = build_store(root, generations)
    return _timings(str(store), root, 3, subprocess_too=True)


# -- S3 (moto on loopback) ------------------------------------------------------------


def copy_to_s3(store: Path, url: str) -> None:
    """Every published generation of a POSIX store, key for key, into an S3 store: the
    same bytes where an S3 save puts them (a manifest holds no path)."""
    from ckptvault.storage.s3.store import S3Store

    source, target = open_store(store), S3Store(url)
    uploads = [
        (target.layout.key_of(ref.name, name), store / ref.name.dirname / name)
        for ref in source.list_generations()
        for name in source.list_entries(ref)
    ]

    def put(item: tuple[str, Path]) -> None:
        target.client.call("put_object", item[0], Body=item[1].read_bytes())

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(put, uploads))


@contextlib.contextmanager
def s3_endpoint() -> Iterator[str]:
    from bench.s3_save import CREDENTIALS, moto_server

    saved = {name: os.environ.get(name) for name in [*CREDENTIALS, "AWS_ENDPOINT_URL"]}
    with moto_server() as endpoint:
        os.environ.update(CREDENTIALS, AWS_ENDPOINT_URL=endpoint)
        try:
            yield endpoint
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def measure_listing_s3(generations: int, root: Path, endpoint: str, reps: int) -> dict[str, float]:
    import boto3

    bucket = f"listing-{generations}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    url = f"s3://{bucket}/store-{generations}"
    copy_to_s3(build_store(root, generations), url)
    return _timings(url, root, reps, subprocess_too=False)


def _table(results: dict[str, dict[int, dict[str, float]]]) -> None:
    for backend, by_count in results.items():
        counts = sorted(by_count)
        print(f"\n{backend}: seconds, best of the runs")
        print("| operation | " + " | ".join(f"{n:,} generations" for n in counts) + " |")
        print("|---|" + "---|" * len(counts))
        for operation in by_count[counts[0]]:
            cells = " | ".join(f"{by_count[n][operation]:.3f}" for n in counts)
            print(f"| {operation} | {cells} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--generations", type=int, nargs="+", default=list(COUNTS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--s3", action="store_true", help="also time an S3 store (moto)")
    parser.add_argument("--dir", type=Path, default=None, help="where the stores are built")
    args = parser.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="ckptvault-listing-"))
    results: dict[str, dict[int, dict[str, float]]] = {"POSIX": {}}
    for count in args.generations:
        store = build_store(root, count)
        results["POSIX"][count] = _timings(str(store), root, args.reps, subprocess_too=True)
        print(f"POSIX, {count} generations: {results['POSIX'][count]}", flush=True)
    if args.s3:
        results["S3 (moto, loopback)"] = {}
        with s3_endpoint() as endpoint:
            for count in args.generations:
                figures = measure_listing_s3(count, root, endpoint, args.reps)
                results["S3 (moto, loopback)"][count] = figures
                print(f"S3, {count} generations: {figures}", flush=True)
    _table(results)


if __name__ == "__main__":
    main()
