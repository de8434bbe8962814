"""What a store location names: which backend, its canonical form, its local path,
and which remote options apply to it.

With :func:`~ckptvault.storage.open_store` this is the one place that reads a
location's URL scheme; everything above ``storage/`` asks these functions instead,
so a new backend is added here and nowhere else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from ckptvault.errors import UsageError
from ckptvault.storage.azure.options import AzureOptions, parse_az_url
from ckptvault.storage.s3.options import S3Options, parse_s3_url

StoreLocation = str | os.PathLike[str]

POSIX, S3, AZURE = "posix", "s3", "azure"
_BACKENDS = {"": POSIX, "file": POSIX, "s3": S3, "az": AZURE}


def backend_of(location: StoreLocation) -> str:
    """``"posix"``, ``"s3"`` or ``"azure"``; ``UsageError`` for another URL scheme."""
    text = os.fspath(location)
    scheme = urlsplit(text).scheme if "://" in text else ""
    backend = _BACKENDS.get(scheme)
    if backend is None:
        raise UsageError(
            f"{text}: unsupported store URL scheme {scheme!r}; give a local path, file://, "
            "s3:// or az:// URL"
        )
    return backend


def local_path(location: StoreLocation) -> Path | None:
    """The local directory a location names (a path or ``file://`` URL, as given);
    None for a remote store, whose free space cannot be asked for."""
    text = os.fspath(location)
    if backend_of(text) != POSIX:
        return None
    if "://" not in text:
        return Path(text)
    parts = urlsplit(text)
    if parts.netloc not in ("", "localhost"):
        raise UsageError(f"{text}: file:// URLs name a local path (file:///abs/path)")
    path = unquote(parts.path)
    if not path:
        raise UsageError(f"{text}: the file:// URL names no path (file:///abs/path)")
    return Path(path)


def canonical_location(location: StoreLocation) -> str:
    """The location as its store names itself (``Store.location``): a path made
    absolute, an object store's URL in its canonical form. Nothing is opened."""
    text = os.fspath(location)
    backend = backend_of(text)
    if backend == S3:
        return parse_s3_url(text).url
    if backend == AZURE:
        return parse_az_url(text).url
    path = local_path(text)
    assert path is not None
    return os.path.abspath(path)


@dataclass(frozen=True)
class RemoteOptions:
    """Options of remote stores as a user gives them once (the manager's keywords,
    the CLI's flags); each backend takes only its own (:meth:`for_location`).

    ``object_lock_days`` is S3 Object Lock on ``s3://`` and a version-level
    immutability policy on ``az://``: the same promise, each service's mechanism.
    """

    s3: S3Options | None = None
    azure: AzureOptions | None = None

    @classmethod
    def from_keywords(
        cls,
        *,
        s3_endpoint_url: str | None = None,
        s3_part_size: int | None = None,
        s3_max_concurrency: int | None = None,
        object_lock_days: int | None = None,
    ) -> RemoteOptions:
        return cls(
            s3=S3Options.from_keywords(
                endpoint_url=s3_endpoint_url,
                part_size=s3_part_size,
                max_concurrency=s3_max_concurrency,
                object_lock_days=object_lock_days,
            ),
            azure=AzureOptions.from_keywords(immutability_days=object_lock_days),
        )

    def for_location(self, location: StoreLocation | Any) -> dict[str, Any]:
        """``open_store`` keywords for ``location``: the options of its backend only
        (none for a store object, which is open already)."""
        if not isinstance(location, (str, os.PathLike)):
            return {}
        backend = backend_of(location)
        if backend == S3 and self.s3 is not None:
            return {"s3": self.s3}
        if backend == AZURE and self.azure is not None:
            return {"azure": self.azure}
        return {}

    def check_used_by(self, *locations: StoreLocation | Any) -> None:
        """``UsageError`` when options were given that none of ``locations`` takes
        (an S3 endpoint or part size without an ``s3://`` store, say)."""
        if self.s3 is None:
            return
        backends = {backend_of(x) for x in locations if isinstance(x, (str, os.PathLike))}
        lock_days_only = self.s3 == S3Options(object_lock_days=self.s3.object_lock_days)
        if S3 in backends or (lock_days_only and AZURE in backends):
            return
        raise UsageError(
            "S3 options (endpoint, part size, ...) apply to s3:// stores only"
            + ("; object_lock_days applies to s3:// and az:// stores" if lock_days_only else "")
        )
