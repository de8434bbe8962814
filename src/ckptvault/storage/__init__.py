"""Where bytes live: the :class:`~ckptvault.storage.base.Store` seam and its backends.

:func:`open_store` is the one way to turn what a user typed (a path, a ``file://``
URL, ``s3://bucket/prefix``, ``az://container/prefix``) into a store; the manager,
export and every CLI command use it. With :mod:`~ckptvault.storage.locations` it is
the one place that looks at a URL's scheme: everything above ``storage/`` sees a
:class:`~ckptvault.storage.base.Store`. The S3
backend (and boto3) is imported only for ``s3://`` URLs, the Azure backend (and its
SDK) only for ``az://``.
"""

from __future__ import annotations

import os

from ckptvault.errors import UsageError
from ckptvault.storage.azure.options import AzureOptions
from ckptvault.storage.base import Store
from ckptvault.storage.locations import (
    AZURE,
    S3,
    RemoteOptions,
    StoreLocation,
    backend_of,
    canonical_location,
    local_path,
)
from ckptvault.storage.posix.store import PosixStore
from ckptvault.storage.s3.options import S3Options

__all__ = [
    "AzureOptions",
    "RemoteOptions",
    "S3Options",
    "Store",
    "StoreLocation",
    "backend_of",
    "canonical_location",
    "local_path",
    "open_store",
]


def open_store(
    location: StoreLocation | Store,
    *,
    must_exist: bool = False,
    s3: S3Options | None = None,
    azure: AzureOptions | None = None,
) -> Store:
    """The store at ``location``: a local path, ``file:///abs/path``,
    ``s3://bucket/prefix`` (with ``s3`` options), ``az://container/prefix`` (with
    ``azure`` options), or a store object. Options of another backend are refused.

    ``must_exist=True`` (tools that only read) raises :class:`UsageError` when there
    is nothing there, instead of treating it as an empty store.
    """
    if isinstance(location, Store):
        return location
    text = os.fspath(location)
    if not text:
        raise UsageError("the store location is empty; give a path or URL")
    backend = backend_of(text)
    if s3 is not None and backend != S3:
        raise UsageError(
            f"{text}: S3 options (endpoint, part size, ...) apply to s3:// stores only"
        )
    if azure is not None and backend != AZURE:
        raise UsageError(f"{text}: Azure options apply to az:// stores only")
    if backend == S3:
        return _open_s3_store(text, must_exist, s3)
    if backend == AZURE:
        return _open_azure_store(text, must_exist, azure)
    root = local_path(text)
    assert root is not None
    store = PosixStore(root)
    if must_exist:
        if not store.root.exists():
            raise UsageError(f"no checkpoint store at {text} (the directory does not exist)")
        if not store.root.is_dir():
            raise UsageError(f"{text} is not a directory")
    return store


def _open_s3_store(url: str, must_exist: bool, options: S3Options | None) -> Store:
    from ckptvault.storage.s3.store import S3Store  # only now: local stores never load boto3

    store = S3Store(url, options)
    if must_exist:
        store.check_bucket()
    return store


def _open_azure_store(url: str, must_exist: bool, options: AzureOptions | None) -> Store:
    from ckptvault.storage.azure.store import AzureStore  # only now: others never load the SDK

    store = AzureStore(url, options)
    if must_exist:
        store.check_container()
    return store
