"""Publishing into an Azure Blob store: the staging area and the manifest-last rule.

Azure Blob has no rename; a generation exists exactly when its manifest blob does.
Publishing a fully written attempt (every data blob committed) is:

1. the written blobs are put under an immutability policy, if asked for
   (``immutability_days``);
2. ``manifest.sig`` (if any) is written with ``If-None-Match: *`` — the signature
   first, so no manifest is ever visible unsigned;
3. the writer lease is renewed — a writer that lost it refuses to publish;
4. ``manifest.json`` is written with ``If-None-Match: *``. Success is the publish;
   a refused condition means someone else published that generation, and this
   attempt fails and removes what it wrote.

A crash anywhere before step 4 leaves no manifest, so no generation: readers never
see the attempt, and ``remove_stale_staging`` deletes its blobs (and the staged
blocks of unfinished ones) later. Each attempt writes under its own generation id
(unique blob names), and Azure honours ``If-None-Match`` on Put Blob and Put Block
List, so unlike S3-compatible servers there is nothing to probe.
"""

from __future__ import annotations

import errno
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from ckptvault.errors import SaveFailedError, UsageError
from ckptvault.format.layout import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    GenerationName,
    generation_dirname,
    parse_generation_dirname,
)
from ckptvault.storage.azure.client import AzureClient, AzureError, AzurePreconditionFailed
from ckptvault.storage.azure.options import AzureOptions
from ckptvault.storage.azure.upload import AzureWritableFile
from ckptvault.storage.azure.versions import Immutability
from ckptvault.storage.base import GenerationRef
from ckptvault.storage.objects.layout import ObjectLayout
from ckptvault.storage.objects.lease import ObjectWriterLease
from ckptvault.storage.objects.staging import ObjectStagingArea
from ckptvault.storage.objects.uploads import PartUploader

logger = logging.getLogger("ckptvault")


class _Staging(Protocol):
    """What a staging area needs of an Azure store
    (:class:`~ckptvault.storage.azure.store.AzureStore`, which imports this module)."""

    @property
    def location(self) -> str: ...

    @property
    def client(self) -> AzureClient: ...

    @property
    def layout(self) -> ObjectLayout: ...

    @property
    def options(self) -> AzureOptions: ...

    @property
    def uploader(self) -> PartUploader: ...

    @property
    def read_pool(self) -> ThreadPoolExecutor: ...

    @property
    def writer_lease(self) -> ObjectWriterLease: ...

    @property
    def immutability(self) -> Immutability: ...

    def ref_for(self, name: GenerationName) -> GenerationRef: ...


class AzureStagingArea(ObjectStagingArea):
    """The data blobs of one save attempt, under ``data/<x>/<generation id>/``: staged
    blocks and one commit each, published by :func:`publish_manifest_last`."""

    store: _Staging

    def __init__(self, store: _Staging, generation_id: str, joined: bool = False) -> None:
        super().__init__(store, generation_id, joined)

    def create_file(self, name: str) -> AzureWritableFile:
        file: AzureWritableFile = super().create_file(name)
        return file

    def _new_file(self, key: str) -> AzureWritableFile:
        store = self.store
        return AzureWritableFile(
            store.client, store.uploader, key, store.options.block_size, self.note_written
        )

    def _delete(self, keys: list[str]) -> None:
        for key in keys:
            self.store.client.delete(key)

    def _publish(self, step: int, manifest: bytes, signature: bytes | None) -> GenerationRef:
        return publish_manifest_last(self, step, manifest, signature)

    def read_staged(self, name: str, limit: int) -> bytes:
        key = self.store.layout.data_key(self.generation_id, name)
        head = self.store.client.head(key)
        if head.size > limit:
            raise OSError(errno.EFBIG, f"{name} is larger than {limit} bytes")
        return self.store.client.get_range(key, 0, head.size, head.etag) if head.size else b""


def publish_manifest_last(
    area: AzureStagingArea, step: int, manifest: bytes, signature: bytes | None
) -> GenerationRef:
    """Steps 1-4 of the module docstring."""
    store = area.store
    name = parse_generation_dirname(generation_dirname(step, area.generation_id))
    if name is None or name.step != step:
        raise UsageError(f"step {step!r} is not a step (an integer from 0 to 2**63-1)")
    unfinished = area.unfinished_files()
    if unfinished:
        raise SaveFailedError(
            f"{', '.join(unfinished)} of {area.location} are still being written; a "
            "generation is published only after every file is committed"
        )
    store.writer_lease.check_held()  # before writing anything more
    store.immutability.check_container()
    store.immutability.apply(area.written_keys(), store.read_pool, step)
    lock = store.immutability.blob_params(step)
    client = store.client
    if signature is not None:
        sig_key = store.layout.generation_key(name, SIGNATURE_NAME)
        client.put_new(sig_key, signature, accept_identical=True, **lock)
        area.note_written(sig_key)
    store.writer_lease.confirm()  # a writer that lost the lease must not publish
    manifest_key = store.layout.generation_key(name, MANIFEST_NAME)
    try:
        client.put_new(manifest_key, manifest, **lock)
    except AzureError as exc:
        # "Exists" may be this very write, retried by the SDK after a lost response:
        # only the blob's bytes tell it from someone else's.
        _after_uncertain_put(area, manifest_key, manifest, exc)
    return store.ref_for(name)


def _after_uncertain_put(
    area: AzureStagingArea, key: str, manifest: bytes, exc: AzureError
) -> None:
    """The manifest write failed, or found the blob there: it may be this write that
    landed. Returns when the blob holds exactly ``manifest``; otherwise raises,
    keeping the attempt's blobs when it cannot tell (a published generation keeps its
    data: "exists" followed by a read that fails is no proof of a lost race)."""
    client = area.store.client
    landed = client.holds_exactly(key, manifest)
    if landed is True:
        return
    if landed is False and isinstance(exc, AzurePreconditionFailed):
        raise SaveFailedError(
            f"{client.url(key)} already exists: someone else published generation "
            f"{area.generation_id}. This save was abandoned and its blobs removed; the "
            "published generation is untouched"
        ) from exc
    if landed is None:
        area.keep_written = True
        raise SaveFailedError(
            f"writing {client.url(key)} failed ({exc}) and whether it landed is unknown. The "
            "data blobs were kept: if the manifest exists the generation is complete, "
            "otherwise remove_stale_staging removes them later"
        ) from exc
    raise SaveFailedError(f"publishing {client.url(key)}: {exc}; nothing was published") from exc
