"""How to reach an S3 store: its URL and the few options a user may set.

Nothing here imports boto3: ``open_store`` and the manager accept these options for
every store, and only an ``s3://`` location ever loads the S3 backend. Endpoint,
credentials and region otherwise come from boto3's own configuration (environment,
profiles, ``AWS_ENDPOINT_URL``), so a store URL never carries secrets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from ckptvault.errors import UsageError
from ckptvault.storage.objects.prefix import parse_prefix

MiB = 1024 * 1024
GiB = 1024 * MiB
MIN_PART_SIZE = 5 * MiB  # S3: every part but the last is at least 5 MiB
MAX_PART_SIZE = 5 * GiB  # S3: no part is larger
DEFAULT_PART_SIZE = 16 * MiB
DEFAULT_MAX_CONCURRENCY = 8
DEFAULT_LEASE_SECONDS = 60.0

# Lowercase S3 bucket names (dots allowed, as S3 does for older buckets).
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]\Z")


@dataclass(frozen=True)
class S3Options:
    """Options of an S3 store; every field has a default.

    ``endpoint_url``: an S3-compatible endpoint (default: boto3's configuration,
    which honours ``AWS_ENDPOINT_URL``). ``part_size``: the first multipart part
    size, 5 MiB to 5 GiB (parts grow by themselves for very large files).
    ``max_concurrency``: parts uploaded (or ranges downloaded) at once per store,
    which also bounds the memory uploads hold. ``object_lock_days``: put every
    published object under Object Lock retention (GOVERNANCE) for that many days;
    the bucket must have Object Lock enabled. ``lease_seconds``: how long the
    writer lease lasts without renewal (a crashed writer on another machine blocks
    new writers that long).
    """

    endpoint_url: str | None = None
    part_size: int = DEFAULT_PART_SIZE
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    object_lock_days: int | None = None
    lease_seconds: float = DEFAULT_LEASE_SECONDS

    def __post_init__(self) -> None:
        if not MIN_PART_SIZE <= self.part_size <= MAX_PART_SIZE:
            raise UsageError(
                f"s3_part_size={self.part_size}: S3 parts are 5 MiB to 5 GiB; give a size in "
                "that range (default 16 MiB)"
            )
        if not 1 <= self.max_concurrency <= 256:
            raise UsageError(f"s3_max_concurrency={self.max_concurrency}: give 1 to 256")
        if self.object_lock_days is not None and not 1 <= self.object_lock_days <= 36500:
            raise UsageError(f"object_lock_days={self.object_lock_days}: give 1 to 36500 days")
        if not 1 <= self.lease_seconds <= 3600:
            raise UsageError(f"lease_seconds={self.lease_seconds}: give 1 to 3600 seconds")
        if self.endpoint_url is not None and not urlsplit(self.endpoint_url).scheme:
            raise UsageError(
                f"s3_endpoint_url={self.endpoint_url!r} is not a URL (http(s)://host:port)"
            )

    @classmethod
    def from_keywords(
        cls,
        *,
        endpoint_url: str | None = None,
        part_size: int | None = None,
        max_concurrency: int | None = None,
        object_lock_days: int | None = None,
    ) -> S3Options | None:
        """The options the keywords set, or None when none was given (the form the
        manager and the CLI forward to ``open_store``)."""
        if (endpoint_url, part_size, max_concurrency, object_lock_days) == (None,) * 4:
            return None
        return cls(
            endpoint_url=endpoint_url,
            part_size=DEFAULT_PART_SIZE if part_size is None else part_size,
            max_concurrency=DEFAULT_MAX_CONCURRENCY if max_concurrency is None else max_concurrency,
            object_lock_days=object_lock_days,
        )


@dataclass(frozen=True)
class S3Location:
    """``s3://<bucket>/<prefix>``: everything of the store lives under ``prefix``."""

    bucket: str
    prefix: str  # "" (the whole bucket) or "a/b/" with a trailing slash

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix.rstrip('/')}".rstrip("/")


def parse_s3_url(text: str) -> S3Location:
    """Parse and validate ``s3://bucket[/prefix]``; ``UsageError`` for anything else.

    The prefix is split into plain components (no ``.``/``..``, nothing hidden, no
    empty component), so every key the store builds stays inside it.
    """
    parts = urlsplit(text)
    if parts.scheme != "s3" or parts.query or parts.fragment or "@" in parts.netloc:
        raise UsageError(f"{text}: an S3 store is s3://bucket/prefix (no query, no credentials)")
    if not _BUCKET_RE.match(parts.netloc) or ".." in parts.netloc:
        raise UsageError(f"{text}: {parts.netloc!r} is not a valid S3 bucket name")
    prefix = parse_prefix(text, parts.path)
    return S3Location(bucket=parts.netloc, prefix=prefix)
