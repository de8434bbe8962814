"""The POSIX backend: a store in a directory tree, published by same-filesystem rename.

``store`` (:class:`PosixStore`, the ``Store`` protocol over a directory), ``files``
(descriptor-relative, ``O_NOFOLLOW`` opens and durable writes), ``publish`` (the
staging area and the rename rule), ``records``, ``replace`` (manifest and signature
replaced in place), ``cleanup`` (deleting generations and stale staging).
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # ``from ckptvault.storage.posix import PosixStore`` (its path before this package)
    # imports the store only when asked: the helpers below it never import it.
    if name == "PosixStore":
        from ckptvault.storage.posix.store import PosixStore

        return PosixStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
