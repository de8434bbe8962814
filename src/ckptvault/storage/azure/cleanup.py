"""Removing what Azure saves leave behind, and deleting published generations.

An attempt that never published leaves committed blobs under its
``data/<x>/<generation id>/`` prefixes and, for a file cut off mid-upload, staged
blocks that belong to no committed blob (Azure lists them only when asked for
uncommitted blobs, keeps them a week, and bills them meanwhile). No lock proves such
an attempt dead, so only age can: :func:`remove_stale_attempts` removes an attempt
only when nothing of it (a blob, a staged blob, the attempt's own start) is newer
than ``older_than`` seconds by the service's clock.

:func:`delete_generation` deletes the manifest first, so the generation stops
existing before any of its bytes go, then the signature, then its blobs; then every
earlier version of them that blob versioning kept (:mod:`~ckptvault.storage.azure.versions`).
A manifest an immutability policy holds is not deleted: the generation stays whole
and is reported as retained.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

from ckptvault.errors import UsageError
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME, generation_id_time
from ckptvault.storage.azure.client import AzureClient, AzureError, Listed, addressable
from ckptvault.storage.azure.versions import purge_versions
from ckptvault.storage.base import GenerationRef
from ckptvault.storage.objects.layout import ObjectLayout
from ckptvault.storage.retained import RetainedCopy

logger = logging.getLogger("ckptvault")


class _Cleaned(Protocol):
    """What cleanup needs of an Azure store (:class:`~ckptvault.storage.azure.store.AzureStore`)."""

    @property
    def client(self) -> AzureClient: ...

    @property
    def layout(self) -> ObjectLayout: ...

    @property
    def read_pool(self) -> ThreadPoolExecutor: ...

    def list_generations(self) -> list[GenerationRef]: ...

    def list_prefixes(self, prefixes: list[str]) -> dict[str, list[Listed]]: ...

    def forget_entries(self, ref: GenerationRef) -> None: ...


@dataclass
class _Attempt:
    """What one unpublished attempt left: committed blobs, staged ones, its last write."""

    newest: float
    keys: list[str] = field(default_factory=list)
    staged: list[str] = field(default_factory=list)


def remove_stale_attempts(store: _Cleaned, older_than: float | None) -> list[str]:
    """Delete what unpublished attempts left, when older than ``older_than`` seconds;
    returns the generation ids removed."""
    if older_than is None:
        return []  # nothing is provably dead without an age (see the module docstring)
    if older_than < 0:
        raise UsageError(f"older_than={older_than}: give a number of seconds >= 0")
    cutoff = store.client.server_now() - older_than
    attempts = _survey(store)
    stale = {gid for gid, attempt in attempts.items() if attempt.newest <= cutoff}
    # Look again right before deleting: an attempt that published meanwhile is kept.
    stale -= {ref.generation_id for ref in store.list_generations()}
    removed = []
    for generation_id in sorted(stale):
        attempt = attempts[generation_id]
        if _written_since(store.client, attempt.keys, cutoff):
            continue  # a listing can lag; a blob's own properties say it is fresh
        try:
            for key in attempt.staged:
                store.client.discard_uncommitted(key)
            for key in attempt.keys:
                store.client.delete(key)
        except AzureError as exc:  # one attempt that cannot go does not stop the pass
            logger.warning("could not remove stale attempt %s yet: %s", generation_id, exc)
            continue
        removed.append(generation_id)
    return removed


def _survey(store: _Cleaned) -> dict[str, _Attempt]:
    """Unpublished attempts by generation id. Only blob names this store makes count
    (``ObjectLayout.parse_data_key``): a store at a container's root must not delete
    another application's blobs under ``data/``."""
    published = {ref.generation_id for ref in store.list_generations()}
    attempts: dict[str, _Attempt] = defaultdict(lambda: _Attempt(newest=0.0))
    root = store.layout.data_root
    committed = list(store.client.list_blobs(root))
    for item, staged in [(i, False) for i in committed] + [
        (i, True) for i in store.client.list_uncommitted(root)
    ]:
        parsed = store.layout.parse_data_key(item.key)
        if parsed is None or parsed[1] in published:
            continue  # a published generation's data, or nothing ckptvault wrote
        attempt = attempts[parsed[1]]
        (attempt.staged if staged else attempt.keys).append(item.key)
        attempt.newest = max(attempt.newest, _timestamp(item.last_modified))
    for generation_id, attempt in attempts.items():
        # The attempt began when its id was made: never older than that.
        attempt.newest = max(attempt.newest, generation_id_time(generation_id).timestamp())
    return dict(attempts)


def _written_since(client: AzureClient, keys: list[str], cutoff: float) -> bool:
    for key in keys:
        try:
            head = client.head(key)
        except FileNotFoundError:
            continue  # gone meanwhile
        if _timestamp(head.last_modified) > cutoff:
            return True
    return False


def _timestamp(value: datetime | None) -> float:
    return value.timestamp() if isinstance(value, datetime) else 0.0


def delete_generation(store: _Cleaned, ref: GenerationRef) -> list[RetainedCopy]:
    """Manifest first (the generation is gone), then signature, then its blobs, then
    their earlier versions; returns what had to stay. Idempotent. Data shared with
    another manifest of the same generation id (only a planted copy can do that) is
    left in place."""
    layout, client = store.layout, store.client
    manifest_key = layout.generation_key(ref.name, MANIFEST_NAME)
    try:
        client.delete(manifest_key)
    except AzureError as exc:
        if exc.code not in ("BlobImmutableDueToPolicy", "BlobImmutableDueToLegalHold"):
            raise
        logger.info("%s stays: %s", client.url(manifest_key), exc)
        return [RetainedCopy(client.url(manifest_key), None, f"the store refused: {exc.code}")]
    client.delete(layout.generation_key(ref.name, SIGNATURE_NAME))
    store.forget_entries(ref)
    prefixes = [layout.generation_prefix(ref.name)]
    if not any(other.generation_id == ref.generation_id for other in store.list_generations()):
        prefixes += list(layout.data_prefixes(ref.generation_id).values())
    listed = store.list_prefixes(prefixes)
    keys = [item.key for items in listed.values() for item in items]
    for key in [key for key in keys if not addressable(key)]:
        logger.warning("%s is not a blob ckptvault wrote; it stays", client.url(key))
    for _done in store.read_pool.map(client.delete, filter(addressable, keys)):
        pass
    return purge_versions(client, store.read_pool, prefixes)
