"""Errors of an object store's requests, shared by its backends (S3, Azure Blob).

Each backend translates its SDK's exceptions into subclasses of these, so that code
written once for every object store (the writer lease, the layout's readers) can
tell "missing" and "someone else got there first" from any other failure. They are
``OSError``: the restore checks report a failed read as ``unreadable`` and a missing
object (:class:`ObjectNotFound`, a ``FileNotFoundError``) as they report a missing
file.
"""

from __future__ import annotations


class ObjectStoreError(OSError):
    """A request to an object store failed; ``code`` is the service's error code
    (or the client's error name)."""

    def __init__(self, err: int, message: str, code: str) -> None:
        super().__init__(err, message)
        self.code = code


class ObjectNotFound(ObjectStoreError, FileNotFoundError):
    """The object, upload or container does not exist."""


class ObjectPreconditionFailed(ObjectStoreError):
    """A conditional request lost: the object exists (``If-None-Match``) or changed
    (``If-Match``)."""
