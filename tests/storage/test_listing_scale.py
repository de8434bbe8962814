"""Listing at scale: what ``ls``, ``generations()`` and the restore's discovery cost,
counted in store operations (never timed here; ``bench/listing_scale.py`` times them).

- ``ls`` (plain, ``--json``, ``--all``) and ``generations()`` list the generations
  once, the deletion marks once (reading only the marks of listed generations), and
  each shown generation's entries once; they read no manifest at all.
- A restore reads the manifest of the candidates it tries, newest first, and no
  other: one when the newest verifies.
- On S3, listing N generations costs pages of 1,000 keys: ``ls`` issues the same
  few ListObjectsV2 requests for 5 generations as for 40, and ``generations/``
  with 1,050 manifests takes two pages. The entries cut out of one store-wide
  listing are judged exactly as a generation listed on its own (rule 5).

Counts come from spies on the real store classes, the real filesystem calls and the
real boto3 client talking to the loopback S3 server.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.cli import main as cli_main
from ckptvault.format.layout import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    GenerationName,
    new_generation_id,
)
from ckptvault.retention.marks import put_mark
from ckptvault.storage import open_store
from ckptvault.storage.objects import store as object_store_module
from ckptvault.storage.objects.layout import spread_digit
from ckptvault.storage.posix import records as posix_records
from ckptvault.storage.posix.store import PosixStore
from ckptvault.storage.s3 import client as s3_client_module
from ckptvault.storage.s3.store import S3Store
from ckptvault.trust.signing import generate_keypair
from support.common import REPO, only_tensor_file, writable
from support.s3_server import s3_client

LISTINGS = ("list_generations", "list_entries", "list_entries_of", "list_records")
READS = ("read_bytes", "open_file", "read_range")


class StoreSpy:
    """Counts what every store of one class is asked: listings by method (records by
    kind), file reads by file name, and how many records a listing read."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, store_class: type) -> None:
        self.listings: Counter[str] = Counter()
        self.reads: Counter[str] = Counter()
        self.records_read: Counter[str] = Counter()
        self._reading = threading.local()
        for method in (*LISTINGS, *READS):
            if hasattr(store_class, method):
                monkeypatch.setattr(
                    store_class, method, self._spy(method, getattr(store_class, method))
                )
        for module in (posix_records, object_store_module):
            monkeypatch.setattr(
                module, "records_to_read", self._spy_records(module.records_to_read)
            )

    def _spy(self, method, real):
        def spied(store, *args, **kwargs):
            if method in READS:
                if getattr(self._reading, "depth", 0):  # read_bytes opens the file itself
                    return real(store, *args, **kwargs)
                self.reads[args[1]] += 1  # (ref, name, ...)
                self._reading.depth = 1
                try:
                    return real(store, *args, **kwargs)
                finally:
                    self._reading.depth = 0
            if method == "list_records":
                self.listings[f"list_records:{args[0]}"] += 1
            else:
                self.listings[method] += 1
            return real(store, *args, **kwargs)

        return spied

    def _spy_records(self, real):
        def spied(names, kind, *args, **kwargs):
            chosen = real(names, kind, *args, **kwargs)
            self.records_read[kind] += len(chosen)
            return chosen

        return spied

    def reset(self) -> None:
        self.listings.clear()
        self.reads.clear()
        self.records_read.clear()


class CountingListdir:
    """Every directory listing the process makes (``os.listdir``), whoever makes it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = os.listdir

        def listdir(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(os, "listdir", listdir)


def save_generations(location, count: int, **options) -> list[str]:
    """``count`` tiny generations (steps 0..count-1); their paths, oldest first."""
    paths = []
    with cv.CheckpointManager(location, run_id="r", catalog=False, metrics=False, **options) as mgr:
        state = {"w": torch.zeros(4)}
        for step in range(count):
            state["w"] += 1
            paths.append(mgr.save(step, state).result().path)
    return paths


def mark(location, steps: list[int]) -> None:
    store = open_store(str(location))
    now = datetime.now(timezone.utc)
    for ref in store.list_generations():
        if ref.step in steps:
            put_mark([store], ref.name, "listing test", now)


def ls(capsys: pytest.CaptureFixture[str], location, *flags: str) -> str:
    capsys.readouterr()
    assert cli_main(["ls", str(location), *flags]) == 0
    return capsys.readouterr().out


# -- POSIX -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def posix_stores(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Two stores, 15 and 60 generations, steps 3 and 7 of each marked for deletion."""
    stores = {}
    for count in (15, 60):
        root = tmp_path_factory.mktemp("listing") / "store"
        save_generations(root, count)
        mark(root, [3, 7])
        stores[count] = root
    return stores


def ls_costs(monkeypatch, capsys, store: Path, *flags: str) -> tuple[dict, int, list[dict]]:
    spy = StoreSpy(monkeypatch, PosixStore)
    listdir = CountingListdir(monkeypatch)
    listed = json.loads(ls(capsys, store, *flags, "--json"))
    costs = {**spy.listings, **{f"read:{n}": c for n, c in spy.reads.items()}}
    costs.update({f"records_read:{k}": c for k, c in spy.records_read.items()})
    return costs, listdir.calls, listed


@pytest.mark.parametrize("flags", [(), ("--all",)], ids=["ls", "ls --all"])
def test_ls_lists_each_generation_once_and_reads_no_manifest(
    posix_stores, monkeypatch, capsys, flags
):
    by_count = {}
    for count, store in posix_stores.items():
        with monkeypatch.context() as patch:
            costs, listdirs, listed = ls_costs(patch, capsys, store, *flags)
        shown = count if flags else count - 2
        assert [g["step"] for g in listed] == sorted(
            (s for s in range(count) if flags or s not in (3, 7)), reverse=True
        )
        assert all(g["bytes"] > 0 for g in listed)
        assert costs.pop("list_entries") == shown  # each shown generation once
        # One listing of the store and one of the marks, reading just the two marks.
        assert costs == {
            "list_generations": 1,
            "list_records:deleted": 1,
            "records_read:deleted": 2,
        }
        # Every directory listing in the process: the root, the marks, one per generation.
        assert listdirs <= shown + 3
        by_count[count] = listdirs - shown
    assert by_count[15] == by_count[60]  # what is not per generation does not grow


def test_plain_ls_and_json_ls_cost_the_same(posix_stores, monkeypatch, capsys):
    store = posix_stores[60]
    with monkeypatch.context() as patch:
        spy = StoreSpy(patch, PosixStore)
        table = ls(capsys, store)
        plain = (Counter(spy.listings), Counter(spy.reads))
    with monkeypatch.context() as patch:
        spy = StoreSpy(patch, PosixStore)
        ls(capsys, store, "--json")
        assert (spy.listings, spy.reads) == plain
    assert len(table.strip().splitlines()) == 1 + 58  # a header, then each shown generation


def test_generations_costs_the_same_as_ls(posix_stores, monkeypatch):
    store = posix_stores[60]
    with cv.CheckpointManager(store, run_id="r", catalog=False, metrics=False) as mgr:
        spy = StoreSpy(monkeypatch, PosixStore)
        shown = mgr.generations()
        assert spy.listings == {
            "list_generations": 1,
            "list_records:deleted": 1,
            "list_entries": 58,
        }
        assert not spy.reads and spy.records_read == {"deleted": 2}
        spy.reset()
        every = mgr.generations(include_marked=True)
        assert spy.listings["list_entries"] == 60 and not spy.reads
    assert len(shown) == 58 and len(every) == 60


def signed_options(root: Path) -> dict:
    """Signing and trusted keys, and the run's ledger, all outside the store."""
    generate_keypair(root / "k.pem", root / "k.pub")
    keys = {"signing_key": root / "k.pem", "trusted_keys": [root / "k.pub"]}
    return {**keys, "ledger": root / "ledger.sqlite3"}


def test_restore_reads_only_the_manifest_of_the_newest_generation(tmp_path, monkeypatch):
    options = signed_options(tmp_path)
    save_generations(tmp_path / "store", 50, **options)
    store = open_store(str(tmp_path / "store"))
    now = datetime.now(timezone.utc)
    for step in range(1000, 1005):  # marks of generations the store does not hold
        put_mark([store], GenerationName(step, new_generation_id()), "planted", now)
    with cv.CheckpointManager(tmp_path / "store", run_id="r", catalog=False, **options) as mgr:
        spy = StoreSpy(monkeypatch, PosixStore)
        listdir = CountingListdir(monkeypatch)
        state = {"w": torch.zeros(4)}
        info = mgr.restore(state)
    assert info.step == 49 and not info.skipped and float(state["w"][0]) == 50.0
    assert spy.reads[MANIFEST_NAME] == 1 and spy.reads[SIGNATURE_NAME] == 1
    assert spy.listings["list_generations"] == 1
    # The marks are listed once; none is read: they name no candidate.
    assert spy.listings["list_records:deleted"] == 1 and not spy.records_read["deleted"]
    assert spy.listings["list_entries"] <= 2  # the newest generation's, nothing older
    assert listdir.calls <= 8  # not one per generation


def test_restore_reads_one_manifest_per_candidate_it_tries(tmp_path, monkeypatch):
    options = signed_options(tmp_path)
    paths = save_generations(tmp_path / "store", 20, **options)
    for path in paths[-2:]:  # the two newest fail verification
        tensor_file = writable(only_tensor_file(Path(path)))
        data = bytearray(tensor_file.read_bytes())
        data[-1] ^= 0xFF
        tensor_file.write_bytes(bytes(data))
    with cv.CheckpointManager(tmp_path / "store", run_id="r", catalog=False, **options) as mgr:
        spy = StoreSpy(monkeypatch, PosixStore)
        info = mgr.restore({"w": torch.zeros(4)})
    assert info.step == 17 and [s.step for s in info.skipped] == [19, 18]
    assert spy.reads[MANIFEST_NAME] == 3 and spy.reads[SIGNATURE_NAME] == 3
    assert spy.listings["list_generations"] == 1


# -- S3 ----------------------------------------------------------------------------------


class S3Requests:
    """Every request the S3 clients ckptvault creates send, by operation, and the keys
    of the objects they GET."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.operations: Counter[str] = Counter()
        self.gets: Counter[str] = Counter()
        real = s3_client_module.make_boto3_client

        def counted(options):
            client = real(options)
            client.meta.events.register("provide-client-params.s3", self._count)
            return client

        monkeypatch.setattr(s3_client_module, "make_boto3_client", counted)

    def _count(self, params, model, **kwargs):
        self.operations[model.name] += 1
        if model.name == "GetObject":
            self.gets[str(params.get("Key", "")).rsplit("/", 1)[-1]] += 1


def test_s3_ls_costs_a_few_listings_whatever_the_number_of_generations(
    s3_bucket, monkeypatch, capsys
):
    lists = {}
    for count in (5, 40):
        url = f"s3://{s3_bucket}/run{count}"
        save_generations(url, count)
        mark(url, [3])
        with monkeypatch.context() as patch:
            requests = S3Requests(patch)
            listed = json.loads(ls(capsys, url, "--all", "--json"))
            assert len(listed) == count and all(g["bytes"] > 0 for g in listed)
            assert [g["step"] for g in listed if "marked" in g] == [3]
            # No manifest, no signature: only the one mark is read.
            assert dict(requests.gets) == {f"{listed[-4]['path'].rsplit('/', 1)[-1]}.json": 1}
            lists[count] = requests.operations["ListObjectsV2"]
            requests.operations.clear()
            with cv.CheckpointManager(url, run_id="r", catalog=False, metrics=False) as mgr:
                assert len(mgr.generations()) == count - 1
            assert requests.operations["ListObjectsV2"] == lists[count]
    # generations/ (twice: names, then entries), data/, the marks: one page each.
    assert lists == {5: 4, 40: 4}


def test_s3_generations_are_listed_in_pages_of_a_thousand_keys(s3_bucket, monkeypatch):
    """1,050 generations (planted manifests: listing reads none of them) take
    ceil(1050 / 1000) = 2 ListObjectsV2 pages."""
    store = S3Store(f"s3://{s3_bucket}/many")
    client = s3_client(os.environ["AWS_ENDPOINT_URL"])
    names = [f"step-{step:012d}.{new_generation_id()}" for step in range(1050)]

    def plant(dirname: str) -> None:
        client.put_object(Bucket=s3_bucket, Key=f"many/generations/{dirname}/{MANIFEST_NAME}")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(plant, names))
    requests = S3Requests(monkeypatch)
    store = S3Store(f"s3://{s3_bucket}/many")
    refs = store.list_generations()
    assert len(refs) == 1050
    assert requests.operations == {"ListObjectsV2": math.ceil(1050 / 1000)}
    requests.operations.clear()
    entries = store.list_entries_of(refs)
    assert all(set(found) == {MANIFEST_NAME} for found in entries.values())
    assert requests.operations == {"ListObjectsV2": 2 + 1}  # generations/ again, data/


def test_s3_entries_cut_from_one_listing_are_judged_like_one_generation_listed_alone(
    s3_bucket,
):
    """Rule 5: objects planted around generations (misplaced, nested, doubled, under a
    look-alike prefix, a second step claiming the same generation id) get the same
    verdicts from the store-wide listing as from each generation's own listing."""
    url = f"s3://{s3_bucket}/hostile"
    save_generations(url, 3)
    store = S3Store(url)
    refs = store.list_generations()
    gid = refs[0].generation_id
    right = spread_digit(gid, 0)
    wrong = next(d for d in "0123456789abcdef" if d != right)
    client = s3_client(os.environ["AWS_ENDPOINT_URL"])
    planted = [
        f"data/{wrong}/{gid}/r00000-000.safetensors",  # the same name twice
        f"data/{right}/{gid}/nested/deeper.bin",
        f"data/{right}/{gid}/",  # a folder marker
        f"data/{right}/{gid}/.hidden",
        f"data/{right}{right}/{gid}/x.bin",  # not a spread prefix
        f"data/{right}/{gid}x/y.bin",  # a look-alike generation id
        f"data/{right}/{gid}",  # no slash after the id
        f"generations/{refs[0].name.dirname}/extra.bin",  # beside the manifest
        f"generations/{refs[0].name.dirname}x/manifest.json",
        f"generations/step-000000000777.{gid}/{MANIFEST_NAME}",  # a second step, same id
    ]
    for key in planted:
        client.put_object(Bucket=s3_bucket, Key=f"hostile/{key}", Body=b"planted")
    refs = store.list_generations()
    assert len(refs) == 4
    one_by_one = {ref.name: store.list_entries(ref) for ref in refs}
    assert store.list_entries_of(refs) == one_by_one
    assert any(entry.unsafe for entry in one_by_one[refs[1].name].values())


# -- the benchmark -----------------------------------------------------------------------


def test_the_listing_benchmark_runs(tmp_path):
    """``bench/listing_scale.py`` still runs (tiny: 3 generations); ``bench/scale.py``
    imports :func:`measure_listing` from it."""
    if str(REPO) not in sys.path:  # bench/ is a package at the repository root
        sys.path.insert(0, str(REPO))
    from bench.listing_scale import measure_listing

    figures = measure_listing(3, tmp_path)
    assert set(figures) == {
        "ls (subprocess)",
        "ls",
        "ls --json",
        "ls --all",
        "generations()",
        "discovery",
        "restore",
    }
    assert all(seconds > 0 for seconds in figures.values())
    assert len(open_store(str(tmp_path / "store-3")).list_generations()) == 3
