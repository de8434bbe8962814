"""The S3 backend's factory and saboteurs for the store conformance suite.

An object store has no links, FIFOs or hard links; what whoever can write the bucket
can plant instead are objects where ckptvault never puts them: keys nested below a
file name, a second copy of a name under another spread prefix, a name under the
wrong spread prefix, a garbage writer lease. Every saboteur also leaves a sentinel
object in the same bucket but outside the store's prefix, and returns a check that
it is still there, unchanged: nothing the store does may reach outside its prefix.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import cast

from ckptvault.storage.base import GenerationRef, Store
from ckptvault.storage.objects.layout import SPREAD_DIGITS, rank_of, spread_digit
from ckptvault.storage.s3.options import S3Options
from ckptvault.storage.s3.store import S3Store
from support.s3_server import new_bucket, s3_client
from support.seaweedfs_server import SESSION_BUCKET

SECRET = b"an object outside the store that must never be served, changed or deleted"
SMALL_PARTS = S3Options(part_size=5 * 1024 * 1024)  # so conformance files go multipart


def make_s3_store(base: Path) -> Store:
    """A fresh store: one bucket per test, one prefix per store within it (so the
    tests with two stores also check that prefixes keep them apart)."""
    endpoint = os.environ["AWS_ENDPOINT_URL"]  # set by the s3_endpoint fixture
    bucket = f"ckv-{hashlib.sha256(str(base.parent).encode()).hexdigest()[:20]}"
    existing = {b["Name"] for b in s3_client(endpoint).list_buckets().get("Buckets", [])}
    if bucket not in existing:
        s3_client(endpoint).create_bucket(Bucket=bucket)
    return S3Store(f"s3://{bucket}/{base.name}/store", SMALL_PARTS)


def make_seaweedfs_store(base: Path) -> Store:
    """A fresh store on SeaweedFS: one prefix per test and per store in the session's
    bucket (a new bucket's first write costs SeaweedFS a volume allocation, 0.2 s)."""
    test = hashlib.sha256(str(base.parent).encode()).hexdigest()[:20]
    return S3Store(f"s3://{SESSION_BUCKET}/{test}/{base.name}/store", SMALL_PARTS)


def fresh_bucket_store(prefix: str = "run", options: S3Options | None = None) -> S3Store:
    return S3Store(f"s3://{new_bucket(os.environ['AWS_ENDPOINT_URL'])}/{prefix}", options)


def _put(store: S3Store, key: str, body: bytes) -> None:
    store.client.raw.put_object(Bucket=store.client.bucket, Key=key, Body=body)


def _outside_kept(store: S3Store, name: str) -> Callable[[], None]:
    """A sentinel beside the store's prefix: ``<prefix>-outside/<name>``."""
    key = f"{store.layout.prefix.rstrip('/')}-outside/{name}"
    _put(store, key, SECRET)

    def check() -> None:
        body = store.client.raw.get_object(Bucket=store.client.bucket, Key=key)["Body"].read()
        assert body == SECRET, f"{key} was changed through the store"

    return check


def _data_prefix(store: S3Store, ref: GenerationRef, digit: str) -> str:
    return store.layout.data_prefix(digit, ref.generation_id)


def _home(ref: GenerationRef, name: str) -> str:
    return spread_digit(ref.generation_id, rank_of(name))


def _elsewhere(ref: GenerationRef, name: str) -> str:
    return next(d for d in SPREAD_DIGITS if d != _home(ref, name))


def plant_directory(store: Store, ref: GenerationRef, name: str) -> Callable[[], None]:
    """Keys nested below ``name`` where the file would live: an object store's directory."""
    s3 = cast(S3Store, store)
    _put(s3, _data_prefix(s3, ref, _home(ref, name)) + f"{name}/inner.bin", SECRET)
    return _outside_kept(s3, name)


def plant_duplicate(store: Store, ref: GenerationRef, name: str) -> Callable[[], None]:
    """``name`` where it belongs and a second copy under another spread prefix."""
    s3 = cast(S3Store, store)
    _put(s3, _data_prefix(s3, ref, _home(ref, name)) + name, b"first copy")
    _put(s3, _data_prefix(s3, ref, _elsewhere(ref, name)) + name, b"second copy")
    return _outside_kept(s3, name)


def plant_misplaced(store: Store, ref: GenerationRef, name: str) -> Callable[[], None]:
    """``name`` only under a spread prefix its writer never uses."""
    s3 = cast(S3Store, store)
    _put(s3, _data_prefix(s3, ref, _elsewhere(ref, name)) + name, SECRET)
    return _outside_kept(s3, name)


def plant_garbage_lock(store: Store) -> Callable[[], None]:
    """A writer lease that is not one: 1 MiB of bytes ckptvault never writes."""
    s3 = cast(S3Store, store)
    _put(s3, s3.layout.lock_key, b"\xff{" * (512 * 1024))
    return _outside_kept(s3, "lock")


S3_ENTRY_SABOTEURS = {
    "directory": plant_directory,
    "duplicate": plant_duplicate,
    "misplaced": plant_misplaced,
}
S3_STORE_SABOTEURS = {"lock_garbage": plant_garbage_lock}
