"""How to reach an Azure Blob store: its URL and the few options a user may set.

Nothing here imports the Azure SDK. The account and its credentials come from the
SDK's usual configuration, never from the store URL (so a URL carries no secret):

- ``AZURE_STORAGE_CONNECTION_STRING`` (an account key or SAS, or Azurite's), else
- an account URL (``account_url=``, else ``AZURE_STORAGE_ACCOUNT_URL``, else
  ``https://$AZURE_STORAGE_ACCOUNT_NAME.blob.core.windows.net``) with
  ``DefaultAzureCredential`` (environment, workload or managed identity, Azure CLI).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from ckptvault.errors import UsageError
from ckptvault.storage.objects.prefix import parse_prefix

MiB = 1024 * 1024
MIN_BLOCK_SIZE = 1 * MiB  # below this a block costs more in requests than it saves
MAX_BLOCK_SIZE = 4000 * MiB  # Azure: no staged block is larger
DEFAULT_BLOCK_SIZE = 16 * MiB
DEFAULT_MAX_CONCURRENCY = 8
DEFAULT_LEASE_SECONDS = 60.0

# Azure container names: 3-63 lowercase letters, digits and single hyphens.
_CONTAINER_RE = re.compile(r"^[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]\Z")


@dataclass(frozen=True)
class AzureOptions:
    """Options of an Azure Blob store; every field has a default.

    ``account_url``: ``https://<account>.blob.core.windows.net`` (default: see the
    module docstring). ``block_size``: the first staged block size, 1 MiB to 4000 MiB
    (blocks grow by themselves for very large files). ``max_concurrency``: blocks
    uploaded (or ranges downloaded) at once per store, which also bounds the memory
    uploads hold. ``immutability_days``: put every published blob under a
    version-level immutability policy (unlocked) for that many days; the container
    must have version-level immutability support. ``lease_seconds``: how long the
    writer lease lasts without renewal.
    """

    account_url: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY
    immutability_days: int | None = None
    lease_seconds: float = DEFAULT_LEASE_SECONDS

    def __post_init__(self) -> None:
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise UsageError(
                f"block size {self.block_size}: Azure blocks are 1 MiB to 4000 MiB here; give "
                "a size in that range (default 16 MiB)"
            )
        if not 1 <= self.max_concurrency <= 256:
            raise UsageError(f"max_concurrency={self.max_concurrency}: give 1 to 256")
        if self.immutability_days is not None and not 1 <= self.immutability_days <= 36500:
            raise UsageError(f"immutability days {self.immutability_days}: give 1 to 36500 days")
        if not 1 <= self.lease_seconds <= 3600:
            raise UsageError(f"lease_seconds={self.lease_seconds}: give 1 to 3600 seconds")
        if self.account_url is not None and urlsplit(self.account_url).scheme not in (
            "http",
            "https",
        ):
            raise UsageError(
                f"account_url={self.account_url!r} is not an account URL "
                "(https://<account>.blob.core.windows.net)"
            )

    @classmethod
    def from_keywords(
        cls,
        *,
        account_url: str | None = None,
        block_size: int | None = None,
        max_concurrency: int | None = None,
        immutability_days: int | None = None,
    ) -> AzureOptions | None:
        """The options the keywords set, or None when none was given."""
        if (account_url, block_size, max_concurrency, immutability_days) == (None,) * 4:
            return None
        return cls(
            account_url=account_url,
            block_size=DEFAULT_BLOCK_SIZE if block_size is None else block_size,
            max_concurrency=DEFAULT_MAX_CONCURRENCY if max_concurrency is None else max_concurrency,
            immutability_days=immutability_days,
        )


@dataclass(frozen=True)
class AzureLocation:
    """``az://<container>/<prefix>``: everything of the store lives under ``prefix``."""

    container: str
    prefix: str  # "" (the whole container) or "a/b/" with a trailing slash

    @property
    def url(self) -> str:
        return f"az://{self.container}/{self.prefix.rstrip('/')}".rstrip("/")


def parse_az_url(text: str) -> AzureLocation:
    """Parse and validate ``az://container[/prefix]``; ``UsageError`` for anything else.

    The prefix is split into plain components (no ``.``/``..``, nothing hidden, no
    empty component), so every blob name the store builds stays inside it.
    """
    parts = urlsplit(text)
    if parts.scheme != "az" or parts.query or parts.fragment or "@" in parts.netloc:
        raise UsageError(
            f"{text}: an Azure Blob store is az://container/prefix (no query, no credentials; "
            "the account comes from AZURE_STORAGE_CONNECTION_STRING or AZURE_STORAGE_ACCOUNT_URL)"
        )
    if not _CONTAINER_RE.match(parts.netloc):
        raise UsageError(
            f"{text}: {parts.netloc!r} is not a valid Azure container name (3-63 lowercase "
            "letters, digits and single hyphens, starting and ending with a letter or digit)"
        )
    prefix = parse_prefix(text, parts.path)
    return AzureLocation(container=parts.netloc, prefix=prefix)
