"""Replacing a published generation's manifest in Azure Blob (key rotation, signing).

The same order as on S3 (:mod:`ckptvault.storage.s3.replace`): read the manifest and
check it is exactly the bytes the caller verified, keeping its ETag; write
``manifest.sig`` (when signed); renew the writer lease; write ``manifest.json`` with
``If-Match`` on that ETag, so a manifest someone changed meanwhile is never replaced.
Each write replaces one blob atomically, so a crash leaves the old pair, the new
signature beside the old manifest (refused by a signature check until the rotation
resumes), or the new pair. Data blobs are never touched. The new versions carry the
old manifest's immutability policy and legal hold (as S3 carries Object Lock), so a
rotation never leaves a locked generation deletable.
"""

from __future__ import annotations

from typing import Protocol

from ckptvault.errors import IntegrityError, UsageError
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME
from ckptvault.storage.azure.client import AzureClient, AzurePreconditionFailed
from ckptvault.storage.azure.versions import carried_hold
from ckptvault.storage.base import EntryInfo, GenerationRef
from ckptvault.storage.objects.layout import ObjectLayout
from ckptvault.storage.objects.lease import ObjectWriterLease


class _Replaced(Protocol):
    """What replacing a manifest needs of an Azure store."""

    @property
    def client(self) -> AzureClient: ...

    @property
    def layout(self) -> ObjectLayout: ...

    @property
    def writer_lease(self) -> ObjectWriterLease: ...

    def list_entries(self, ref: GenerationRef) -> dict[str, EntryInfo]: ...

    def forget_entries(self, ref: GenerationRef) -> None: ...


def replace_manifest(
    store: _Replaced, ref: GenerationRef, manifest: bytes, signature: bytes | None, replaces: bytes
) -> None:
    """See the module docstring; needs the writer lease."""
    store.writer_lease.check_held()
    client = store.client
    manifest_key = store.layout.generation_key(ref.name, MANIFEST_NAME)
    where = client.url(manifest_key)
    head = client.head(manifest_key)
    current = b""
    if head.size == len(replaces) and replaces:
        current = client.get_range(manifest_key, 0, head.size, head.etag)
    if current != replaces:
        raise IntegrityError(
            f"{where} is not the manifest that was verified (it changed meanwhile); nothing "
            "was replaced. Verify the generation again"
        )
    store.forget_entries(ref)
    if signature is None and SIGNATURE_NAME in store.list_entries(ref):
        raise UsageError(
            f"{ref.location} is signed: replacing its manifest needs a new signature, or the "
            "old one would be left over other bytes"
        )
    hold = carried_hold(head)  # the new versions stay as locked as the old ones
    try:
        if signature is not None:
            client.put(store.layout.generation_key(ref.name, SIGNATURE_NAME), signature, **hold)
        store.writer_lease.confirm()
        client.put_if_match(manifest_key, manifest, head.etag, **hold)
    except AzurePreconditionFailed as exc:
        raise IntegrityError(
            f"{where} changed while its replacement was written; the manifest was not replaced "
            "(its signature may already be the new one: run the rotation again to finish it)"
        ) from exc
    finally:
        store.forget_entries(ref)
