"""Replacing a published generation's manifest on S3 (key rotation, signing).

Key rotation (``ckptvault.ops.rotation.rotate``) rewrites the key wrapping in a manifest, so
the manifest's bytes and signature change; data objects are never touched. S3 has no
rename, so the order is:

1. HEAD and GET the manifest: it must be exactly the bytes the caller verified;
   its ETag is kept;
2. ``manifest.sig`` is PUT (when the generation is signed);
3. the writer lease is renewed — a writer that lost it writes nothing more;
4. ``manifest.json`` is PUT with ``If-Match`` on the ETag of step 1: when someone
   changed it meanwhile, the PUT is refused and the generation keeps its manifest.

Each PUT replaces one object atomically, so a crash leaves the old pair, the new
signature beside the old manifest (a signature check refuses it until the rotation
resumes and finishes it), or the new pair. Objects under Object Lock keep their
retention: the new objects get the old manifest's mode, date and legal hold. In a
versioned bucket the old manifest stays as a noncurrent version, still wrapped by
the old KEK: unreadable once that KEK is destroyed.
"""

from __future__ import annotations

from typing import Any, Protocol

from ckptvault.errors import IntegrityError, UsageError
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME
from ckptvault.storage.base import EntryInfo, GenerationRef
from ckptvault.storage.objects.layout import ObjectLayout
from ckptvault.storage.objects.lease import ObjectWriterLease
from ckptvault.storage.s3.client import CHECKSUM, S3Client, S3PreconditionFailed


class _Replaced(Protocol):
    """What replacing a manifest needs of an S3 store (:class:`~ckptvault.storage.s3.store.S3Store`)."""

    @property
    def client(self) -> S3Client: ...

    @property
    def layout(self) -> ObjectLayout: ...

    @property
    def writer_lease(self) -> ObjectWriterLease: ...

    def list_entries(self, ref: GenerationRef) -> dict[str, EntryInfo]: ...

    def forget_entries(self, ref: GenerationRef) -> None: ...


_LOCK_FIELDS = ("ObjectLockMode", "ObjectLockRetainUntilDate", "ObjectLockLegalHoldStatus")


def replace_manifest(
    store: _Replaced,
    ref: GenerationRef,
    manifest: bytes,
    signature: bytes | None,
    replaces: bytes,
) -> None:
    """Steps 1-4 of the module docstring."""
    store.writer_lease.check_held()
    client = store.client
    manifest_key = store.layout.generation_key(ref.name, MANIFEST_NAME)
    where = client.url(manifest_key)
    head = client.call("head_object", manifest_key)
    etag = str(head["ETag"])
    current = b""
    if int(head["ContentLength"]) == len(replaces) and replaces:
        current, _ = client.get_bytes(manifest_key, IfMatch=etag)
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
    lock: dict[str, Any] = {field: head[field] for field in _LOCK_FIELDS if head.get(field)}
    try:
        if signature is not None:
            signature_key = store.layout.generation_key(ref.name, SIGNATURE_NAME)
            client.call(
                "put_object", signature_key, Body=signature, ChecksumAlgorithm=CHECKSUM, **lock
            )
        store.writer_lease.confirm()
        client.call(
            "put_object",
            manifest_key,
            Body=manifest,
            IfMatch=etag,
            ChecksumAlgorithm=CHECKSUM,
            **lock,
        )
    except S3PreconditionFailed as exc:
        raise IntegrityError(
            f"{where} changed while its replacement was written; the manifest was not replaced "
            "(its signature may already be the new one: run the rotation again to finish it)"
        ) from exc
    finally:
        store.forget_entries(ref)
