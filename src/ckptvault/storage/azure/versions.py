"""Blob versions and immutability policies: every copy of a generation, and what holds it.

With blob versioning on, deleting a blob keeps its earlier versions, stored and
billed: copies of the generation all the same. A version-level immutability policy
(or a legal hold) forbids deleting a version before its expiry. This mirrors the S3
backend's versions and Object Lock (:mod:`ckptvault.storage.s3.versions`):

- :class:`Immutability` (``immutability_days``) puts published blobs under an
  *unlocked* version-level policy (Azure's counterpart of Object Lock GOVERNANCE:
  an account with the right role can still shorten it), for the generations its rule
  (milestones) selects; the container must support version-level immutability.
- :func:`purge_versions` deletes every version under a deleted generation's
  prefixes, then lists again: what stays is a :class:`RetainedCopy` with its reason
  (``locked until <date>``, ``under legal hold``, or the refusal), never a failure.
- :func:`blob_hold` reads a blob's policy and legal hold from its properties.

Whether the account keeps versions is a setting of the account (not visible to a
data-plane client); listing with versions tells, so a purge always lists them.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any

from ckptvault.errors import UsageError
from ckptvault.storage.azure.client import (
    AzureClient,
    AzureError,
    AzureNotFound,
    BlobHead,
    Listed,
    addressable,
)
from ckptvault.storage.retained import LockRule, RetainedCopy, locked_until

logger = logging.getLogger("ckptvault")

LEGAL_HOLD = "under legal hold"


class Immutability:
    """``immutability_days``: published blobs under a version-level policy. Which
    generations is ``rule`` (step -> lock it), installed by the manager from its
    retention policy; None locks every generation."""

    def __init__(self, client: AzureClient, days: int | None) -> None:
        self.client = client
        self.days = days
        self.rule: LockRule | None = None
        self._checked = False

    def check_container(self) -> None:
        """``UsageError`` when immutability is asked for but the container cannot hold it."""
        if self.days is None or self._checked:
            return
        props = self.client.call(
            f"reading az://{self.client.container}", self.client.raw.get_container_properties
        )
        if not getattr(props, "immutable_storage_with_versioning_enabled", False):
            raise UsageError(
                f"immutability_days={self.days}: container {self.client.container} does not "
                "have version-level immutability support, so published blobs cannot be put "
                "under a policy. Use a container created with it (az storage container-rm "
                "create --enable-vlw), or drop the days"
            )
        self._checked = True

    def locks(self, step: int) -> bool:
        return self.days is not None and (self.rule is None or self.rule(step))

    def until(self) -> datetime:
        assert self.days is not None
        return datetime.now(timezone.utc) + timedelta(days=self.days)

    def blob_params(self, step: int) -> dict[str, Any]:
        """Upload parameters that put a new blob of a generation of ``step`` under the
        policy, or none."""
        if not self.locks(step):
            return {}
        return {"immutability_policy": _policy(self.until())}

    def apply(self, keys: list[str], pool: ThreadPoolExecutor, step: int) -> None:
        """Put existing blobs of a generation of ``step`` under the policy (in parallel)."""
        if self.locks(step):
            self._lock(keys, pool, self.until(), extend_only=False)

    def lock_now(self, keys: list[str], pool: ThreadPoolExecutor) -> datetime | None:
        """Put published blobs under the policy for ``immutability_days`` from now (a
        pin), never shortening a longer one; the date, or None without days."""
        if self.days is None:
            return None
        self.check_container()
        until = self.until()
        self._lock(keys, pool, until, extend_only=True)
        return until

    def _lock(
        self, keys: list[str], pool: ThreadPoolExecutor, until: datetime, extend_only: bool
    ) -> None:
        def lock(key: str) -> None:
            if extend_only:
                current = self.client.head(key).immutable_until
                if current is not None and current >= until:
                    return  # already held longer
            blob = self.client.blob(key)
            self.client.call(
                f"locking {self.client.url(key)}",
                lambda: blob.set_immutability_policy(_policy(until)),
            )

        for _done in pool.map(lock, keys):
            pass


def _policy(until: datetime, mode: str = "Unlocked") -> Any:
    from azure.storage.blob import ImmutabilityPolicy

    return ImmutabilityPolicy(expiry_time=until, policy_mode=mode)


def carried_hold(head: BlobHead) -> dict[str, Any]:
    """Upload parameters that put a new version of a blob under what holds the version
    ``head`` describes (its policy while unexpired, its legal hold): a manifest
    replaced by key rotation stays as locked as the one it replaces, as on S3."""
    params: dict[str, Any] = {}
    until = head.immutable_until
    if until is not None and until > datetime.now(timezone.utc):
        locked = str(head.immutable_mode).lower() == "locked"
        params["immutability_policy"] = _policy(until, "Locked" if locked else "Unlocked")
    if head.legal_hold:
        params["legal_hold"] = True
    return params


def blob_hold(
    client: AzureClient, key: str, version_id: str | None = None
) -> tuple[str, datetime | None] | None:
    """Why ``key`` (that version) may not be deleted now: ``("locked until <date>",
    date)`` or ``("under legal hold", date or None)``; None when nothing holds it."""
    head = client.head(key, version_id)
    if head.legal_hold:
        return LEGAL_HOLD, head.immutable_until
    until = head.immutable_until
    if until is not None and until > datetime.now(timezone.utc):
        return locked_until(until), until
    return None


def purge_key(client: AzureClient, key: str) -> None:
    """Delete every earlier version of one small blob (a record) after its deletion,
    as S3's ``purge_key`` does: with versioning on, deleted marks, pins and leases
    would otherwise pile up as versions, stored and billed. What may not go stays;
    the record is deleted either way."""
    try:
        for item in client.list_blobs(key, versions=True):
            if item.key == key and item.version_id and not item.is_current:
                client.delete(key, item.version_id)
    except AzureError as exc:
        logger.debug("earlier versions of %s stay: %s", client.url(key), exc)


def purge_versions(
    client: AzureClient, pool: ThreadPoolExecutor, prefixes: list[str]
) -> list[RetainedCopy]:
    """Delete every version left under ``prefixes`` (a deleted generation's own
    prefixes, its current blobs already deleted); returns the versions that stay."""
    refused: dict[tuple[str, str | None], str] = {}
    for item in _versions_under(client, pool, prefixes):
        try:
            client.delete(item.key, item.version_id)
        except AzureError as exc:
            refused[(item.key, item.version_id)] = str(exc)
    if not refused:
        return []
    left = _versions_under(client, pool, prefixes)
    return [
        _retained(client, item.key, item.version_id, refused.get((item.key, item.version_id)))
        for item in left
    ]


def _versions_under(
    client: AzureClient, pool: ThreadPoolExecutor, prefixes: list[str]
) -> list[Listed]:
    """Every version under ``prefixes``, less names no request can address
    (:func:`~ckptvault.storage.azure.client.addressable`): planted, never a copy of
    the generation, and left alone rather than reported as one that stays."""
    return [
        item
        for items in pool.map(lambda p: list(client.list_blobs(p, versions=True)), prefixes)
        for item in items
        if addressable(item.key)
    ]


def _retained(
    client: AzureClient, key: str, version_id: str | None, refusal: str | None
) -> RetainedCopy:
    try:
        hold = blob_hold(client, key, version_id)
    except AzureNotFound:
        hold = None
    except AzureError as exc:
        logger.debug("cannot read the policy of %s (%s): %s", client.url(key), version_id, exc)
        hold = None
    if hold is not None:
        return RetainedCopy(client.url(key), version_id, hold[0], hold[1])
    return RetainedCopy(client.url(key), version_id, refusal or "the store refused to delete it")
