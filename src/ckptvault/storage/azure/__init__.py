"""The Azure Blob Storage backend: a store under a container prefix, ``az://container/prefix``.

``store`` (:class:`AzureStore`), ``client`` (the SDK's calls and their errors),
``options`` (URL and settings; no SDK), ``upload`` (staged blocks, one commit),
``publish`` (the staging area and the manifest-last rule), ``cleanup`` (stale
attempts, uncommitted blocks, deleting generations), ``versions`` (blob versions and
immutability policies). The key layout and the writer lease are the ones every object
store shares (:mod:`ckptvault.storage.objects`). Only ``client`` loads the SDK.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # ``from ckptvault.storage.azure import AzureStore``, loaded only when asked.
    if name == "AzureStore":
        from ckptvault.storage.azure.store import AzureStore

        return AzureStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
