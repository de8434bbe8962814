"""The Azure Blob backend's factory and saboteurs for the store conformance suite.

Azure Blob, like S3, has no links, FIFOs or hard links; what whoever can write the
container can plant instead are blobs where ckptvault never puts them: names nested
below a file name, a second copy of a name under another spread prefix, a name under
the wrong spread prefix, a garbage writer lease. They are written through the plain
SDK (not ckptvault's client). Every saboteur also leaves a sentinel blob in the same
container but outside the store's prefix, and returns a check that it is still
there, unchanged: nothing the store does may reach outside its prefix.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import cast

from ckptvault.storage.azure.store import AzureStore
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.storage.objects.layout import SPREAD_DIGITS, rank_of, spread_digit
from support.azurite_server import ENV_VAR, new_container, service_client

SECRET = b"a blob outside the store that must never be served, changed or deleted"


def make_azure_store(base: Path) -> Store:
    """A fresh store: one container per test, one prefix per store within it (so the
    tests with two stores also check that prefixes keep them apart)."""
    conn_str = os.environ[ENV_VAR]  # set by the azure_env fixture
    container = f"ckv-{hashlib.sha256(str(base.parent).encode()).hexdigest()[:20]}"
    client = service_client(conn_str).get_container_client(container)
    if not client.exists():
        client.create_container()
    return AzureStore(f"az://{container}/{base.name}/store")


def fresh_container_store(prefix: str = "run") -> AzureStore:
    return AzureStore(f"az://{new_container(os.environ[ENV_VAR])}/{prefix}")


def _put(store: AzureStore, name: str, body: bytes) -> None:
    store.client.raw.upload_blob(name, body, overwrite=True)


def _outside_kept(store: AzureStore, name: str) -> Callable[[], None]:
    """A sentinel beside the store's prefix: ``<prefix>-outside/<name>``."""
    key = f"{store.layout.prefix.rstrip('/')}-outside/{name}"
    _put(store, key, SECRET)

    def check() -> None:
        body = store.client.raw.download_blob(key).readall()
        assert body == SECRET, f"{key} was changed through the store"

    return check


def _data_prefix(store: AzureStore, ref: GenerationRef, digit: str) -> str:
    return store.layout.data_prefix(digit, ref.generation_id)


def _home(ref: GenerationRef, name: str) -> str:
    return spread_digit(ref.generation_id, rank_of(name))


def _elsewhere(ref: GenerationRef, name: str) -> str:
    return next(d for d in SPREAD_DIGITS if d != _home(ref, name))


def plant_directory(store: Store, ref: GenerationRef, name: str) -> Callable[[], None]:
    """Blobs nested below ``name`` where the file would live: a virtual directory."""
    az = cast(AzureStore, store)
    _put(az, _data_prefix(az, ref, _home(ref, name)) + f"{name}/inner.bin", SECRET)
    return _outside_kept(az, name)


def plant_duplicate(store: Store, ref: GenerationRef, name: str) -> Callable[[], None]:
    """``name`` where it belongs and a second copy under another spread prefix."""
    az = cast(AzureStore, store)
    _put(az, _data_prefix(az, ref, _home(ref, name)) + name, b"first copy")
    _put(az, _data_prefix(az, ref, _elsewhere(ref, name)) + name, b"second copy")
    return _outside_kept(az, name)


def plant_misplaced(store: Store, ref: GenerationRef, name: str) -> Callable[[], None]:
    """``name`` only under a spread prefix its writer never uses."""
    az = cast(AzureStore, store)
    _put(az, _data_prefix(az, ref, _elsewhere(ref, name)) + name, SECRET)
    return _outside_kept(az, name)


def plant_garbage_lock(store: Store) -> Callable[[], None]:
    """A writer lease that is not one: 1 MiB of bytes ckptvault never writes."""
    az = cast(AzureStore, store)
    _put(az, az.layout.lock_key, b"\xff{" * (512 * 1024))
    return _outside_kept(az, "lock")


AZURE_ENTRY_SABOTEURS = {
    "directory": plant_directory,
    "duplicate": plant_duplicate,
    "misplaced": plant_misplaced,
}
AZURE_STORE_SABOTEURS = {"lock_garbage": plant_garbage_lock}
