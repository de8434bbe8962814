"""The S3 backend: a store under a bucket prefix, published by a conditional manifest PUT.

``store`` (:class:`S3Store`), ``client`` (boto3 calls and their errors), ``options``
(URL and settings; no boto3), ``layout`` (keys), ``upload`` (multipart parts),
``publish`` (the staging area and the manifest-last rule), ``read`` (ranged reads),
``lease`` (the writer lease), ``replace``, ``versions`` (versioning and Object Lock),
``cleanup``. Only ``store`` and what it calls load boto3.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # ``from ckptvault.storage.s3 import S3Store`` (its path before this package),
    # loaded only when asked: local stores never load boto3.
    if name == "S3Store":
        from ckptvault.storage.s3.store import S3Store

        return S3Store
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
