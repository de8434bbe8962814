"""A hostile review of the Azure Blob backend, on Azurite: whoever can write the
container (plant blobs with odd names or encodings, flood ``data/``) and a flaky
network (a lost response on the manifest write) must not make ckptvault serve bytes
other than those stored, delete anything outside the store, or break a generation it
published.

Each test names the hole it closes; the review's report lists what held.
"""

from __future__ import annotations

import dataclasses
import datetime
import gzip
import hashlib
import http.client
import os
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from azure.core.exceptions import ResourceExistsError, ServiceResponseError
from azure.storage.blob import ContentSettings

from ckptvault.errors import SaveFailedError
from ckptvault.format.layout import MANIFEST_NAME, new_generation_id
from ckptvault.storage.azure import store as azure_store_module
from ckptvault.storage.azure.client import AzureClient, Listed
from ckptvault.storage.azure.options import AzureOptions
from ckptvault.storage.azure.store import AzureStore
from ckptvault.storage.base import GenerationRef
from support.azurite_server import ACCOUNT, ACCOUNT_KEY, ENV_VAR, service_client

MiB = 1024 * 1024
TENSOR_FILE = "r00000-000.safetensors"


def digest(data: bytes) -> tuple[int, str]:
    """What a failure message shows of bytes that may be megabytes long."""
    return len(data), hashlib.sha256(data).hexdigest()


def raw_container(name: str) -> Any:
    """The SDK's own client for container ``name`` (planting and inspection)."""
    return service_client(os.environ[ENV_VAR]).get_container_client(name)


_WRITERS: list[AzureStore] = []


@pytest.fixture(autouse=True)
def _release_writers() -> Iterator[None]:
    """Every lease a test took is released while Azurite still answers (a store
    collected later would release it against a stopped emulator, through retries)."""
    yield
    while _WRITERS:
        _WRITERS.pop().release_writer()


def writer(container: str, prefix: str = "run", options: AzureOptions | None = None) -> AzureStore:
    store = AzureStore(f"az://{container}/{prefix}", options)
    store.acquire_writer()
    _WRITERS.append(store)
    return store


def publish(store: AzureStore, step: int, files: dict[str, bytes]) -> GenerationRef:
    area = store.begin_generation(new_generation_id())
    for name, data in files.items():
        sink = area.create_file(name)
        sink.write(data)
        sink.commit()
    return area.publish(step, b'{"manifest": %d}' % step)


# -- bytes served are the bytes stored ----------------------------------------------


def test_a_gzip_encoded_blob_is_served_as_stored_never_inflated(azure_container: str):
    """The SDK inflates a blob whose Content-Encoding says gzip unless told not to, and
    does it in memory before any bound applies: a 16 KiB blob planted as a manifest or
    record (every size check passes on the stored size) became 16 MiB in memory, a
    record's 64 KiB would be 64 MiB, a data range of 8 MiB up to 8 GiB. The bytes
    served must be exactly those stored, so the bounds hold."""
    store = writer(azure_container)
    ref = publish(store, 1, {TENSOR_FILE: b"t" * 100})
    raw = raw_container(azure_container)
    bomb = gzip.compress(b"\0" * (16 * MiB))
    manifest_key = store.layout.generation_key(ref.name, MANIFEST_NAME)
    gzipped = ContentSettings(content_encoding="gzip")
    raw.upload_blob(manifest_key, bomb, overwrite=True, content_settings=gzipped)
    assert digest(store.read_bytes(ref, MANIFEST_NAME, MiB)) == digest(bomb)
    with store.open_file(ref, MANIFEST_NAME) as stream:
        assert digest(stream.read()) == digest(bomb)
    # A record's inflated bytes were trusted as the record the blob does not hold.
    store.put_record("pinned", "planted", {"pinned": True})
    record_key = store.layout.record_key("pinned", "planted")
    body = gzip.compress(b'{"pinned":true}')
    raw.upload_blob(record_key, body, overwrite=True, content_settings=gzipped)
    assert store.list_records("pinned") == {}


# -- nothing outside the store is ever deleted ----------------------------------------


def _sas_connection_string(port: int) -> str:
    """A connection string with an account SAS (not the account key): a request's
    path is then not part of what is signed, as with Entra ID tokens."""
    from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

    sas = generate_account_sas(
        ACCOUNT,
        ACCOUNT_KEY,
        resource_types=ResourceTypes(service=True, container=True, object=True),
        permission=AccountSasPermissions(
            read=True, write=True, delete=True, list=True, create=True, add=True
        ),
        expiry=datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(hours=1),
    )
    return f"BlobEndpoint=http://127.0.0.1:{port}/{ACCOUNT};SharedAccessSignature={sas}"


def _plant_raw(port: int, connection: str, container: str, name: str, body: bytes) -> None:
    """Put a blob named exactly ``name`` (dot segments included) with a plain HTTP
    request, as any client that does not resolve them can."""
    sas = connection.split("SharedAccessSignature=", 1)[1]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(
            "PUT",
            f"/{ACCOUNT}/{container}/{name}?{sas}",
            body=body,
            headers={"x-ms-blob-type": "BlockBlob", "x-ms-version": "2021-08-06"},
        )
        response = conn.getresponse()
        response.read()
        assert response.status == 201, response.status
    finally:
        conn.close()


def test_a_planted_name_with_dot_segments_never_deletes_outside_the_store(
    azure_container: str, monkeypatch: pytest.MonkeyPatch
):
    """The service keeps a blob name such as ``data/3/<id>/x/../../../../../victim``
    as it is, but the HTTP layer below the SDK resolves the ``..`` segments of a
    request's path: deleting that listed name deleted ``victim``, a blob outside the
    store's prefix (with a SAS or an Entra ID token; an account key's signature
    covers the path, so there the request merely failed). Deleting a generation must
    leave such a planted blob alone and never touch what lies outside the prefix."""
    port = int(os.environ[ENV_VAR].split("127.0.0.1:")[1].split("/")[0])
    connection = _sas_connection_string(port)
    monkeypatch.setenv(ENV_VAR, connection)
    raw = raw_container(azure_container)
    raw.upload_blob("victim", b"another application's blob")
    store = writer(azure_container)
    ref = publish(store, 1, {TENSOR_FILE: b"t" * 100})
    planted = store.layout.data_prefix("3", ref.generation_id) + "x/../../../../../victim"
    _plant_raw(port, connection, azure_container, planted, b"planted")
    # Nothing of the generation stays; the planted blob is not a copy of it.
    assert store.delete_generation_reporting(ref) == []
    names = {blob.name for blob in raw.list_blobs()}
    assert "victim" in names, "deleting a generation deleted a blob outside the store"
    assert store.list_generations() == []


# -- a lost response never breaks a published generation ------------------------------


class _LostResponse:
    """A blob client whose upload lands but whose response is lost: the SDK's retry
    then meets the blob it just wrote (409 BlobAlreadyExists). Reading the blob back
    fails too (the network is still flaky)."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def upload_blob(self, *args: Any, **kwargs: Any) -> Any:
        self._inner.upload_blob(*args, **kwargs)
        exc = ResourceExistsError("The specified blob already exists.")
        exc.status_code = 409
        exc.error_code = "BlobAlreadyExists"
        raise exc

    def get_blob_properties(self, *args: Any, **kwargs: Any) -> Any:
        raise ServiceResponseError("connection reset by peer")


def test_a_manifest_whose_landing_cannot_be_checked_keeps_the_generations_data(
    azure_container: str, monkeypatch: pytest.MonkeyPatch
):
    """The manifest write lands, its response is lost, the retry answers "already
    exists", and the read that would tell "ours" from "someone else's" fails. That
    was taken for a lost race: the attempt deleted its data blobs and signature, under
    the manifest it had just published. Unknown must keep them."""
    store = writer(azure_container, options=AzureOptions(block_size=MiB))
    area = store.begin_generation(new_generation_id())
    sink = area.create_file(TENSOR_FILE)
    sink.write(b"d" * (2 * MiB + 7))  # several staged blocks
    sink.commit()
    step = 3
    manifest = b'{"manifest": 3}'
    real_blob = store.client.blob

    def flaky(key: str) -> Any:
        inner = real_blob(key)
        return _LostResponse(inner) if key.endswith("/" + MANIFEST_NAME) else inner

    monkeypatch.setattr(store.client, "blob", flaky)
    with pytest.raises(SaveFailedError, match="unknown"):
        area.publish(step, manifest)
    monkeypatch.undo()
    (ref,) = store.list_generations()
    assert store.read_bytes(ref, MANIFEST_NAME, MiB) == manifest
    entries = store.list_entries(ref)
    assert entries[TENSOR_FILE].size == 2 * MiB + 7 and entries[TENSOR_FILE].unsafe is None


# -- what ls costs does not grow with planted keys -------------------------------------


def test_ls_reads_no_more_blobs_than_listing_each_generation_would(
    azure_container: str, monkeypatch: pytest.MonkeyPatch
):
    """``list_entries_of`` (``ls``, retention) cuts every generation's entries out of
    one listing of all of ``data/``. Blobs there that belong to no listed generation
    (planted by the million, or another application's at a container's root) were
    all listed and held: the cost grew with them without bound. Past what listing
    each generation alone costs, each generation is listed alone instead (as S3 does):
    the same entries, the same verdicts."""
    store = writer(azure_container)
    for step in (1, 2):
        publish(store, step, {TENSOR_FILE: b"t" * 10})
    raw = raw_container(azure_container)

    def plant(index: int) -> None:
        raw.upload_blob(f"run/data/other/{index:05d}", b"x")

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(plant, range(120)))
    refs = store.list_generations()
    one_by_one = {ref.name: store.list_entries(ref) for ref in refs}
    # The budget scaled down to what a quick test plants.
    monkeypatch.setattr(azure_store_module, "BULK_LISTING_KEYS_PER_GENERATION", 20)
    consumed: Counter[str] = Counter()
    listing = AzureClient.list_blobs

    def counted(self: AzureClient, prefix: str, *, versions: bool = False) -> Iterator[Listed]:
        for item in listing(self, prefix, versions=versions):
            consumed[prefix] += 1
            yield item

    monkeypatch.setattr(AzureClient, "list_blobs", counted)
    assert store.list_entries_of(refs) == one_by_one
    assert consumed["run/data/"] <= 2 * 20 + 1


# -- key rotation keeps a locked generation locked ---------------------------------------


def test_a_replaced_manifest_stays_under_the_old_ones_policy_and_hold(
    azure_container: str, monkeypatch: pytest.MonkeyPatch
):
    """Key rotation writes a new signature and a new manifest version. On S3 they carry
    the old manifest's Object Lock; on Azure they carried nothing, so after a rotation
    the manifest's current version was under no policy: ``retained_until`` said
    nothing held it and retention deleted it (the generation gone from every listing)
    before its lock date. Azurite keeps no policies, so the manifest's properties are
    made to report one and what the new versions are written with is recorded."""
    store = writer(azure_container)
    old = b'{"manifest": 1}'
    area = store.begin_generation(new_generation_id())
    ref = area.publish(1, old, b"old signature")
    manifest_key = store.layout.generation_key(ref.name, MANIFEST_NAME)
    until = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=30)
    real_head, real_blob = store.client.head, store.client.blob
    written: dict[str, dict[str, Any]] = {}

    def held_head(key: str, version_id: str | None = None) -> Any:
        head = real_head(key, version_id)
        if key != manifest_key:
            return head
        return dataclasses.replace(
            head, immutable_until=until, immutable_mode="Unlocked", legal_hold=True
        )

    class Recorded:
        def __init__(self, key: str) -> None:
            self._key, self._inner = key, real_blob(key)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._inner, name)

        def upload_blob(self, *args: Any, **kwargs: Any) -> Any:
            if self._key.startswith(store.layout.generations_prefix):  # not the lease
                written[self._key] = kwargs
            return self._inner.upload_blob(*args, **kwargs)

    monkeypatch.setattr(store.client, "head", held_head)
    monkeypatch.setattr(store.client, "blob", Recorded)
    store.replace_manifest(ref, b'{"manifest": 2}', b"new signature", replaces=old)
    assert set(written) == {manifest_key, manifest_key.replace(MANIFEST_NAME, "manifest.sig")}
    for key, params in written.items():
        policy = params.get("immutability_policy")
        assert policy is not None and policy.expiry_time == until, f"{key} was written unlocked"
        assert params.get("legal_hold") is True, f"{key} was written without the legal hold"


# -- what held: an attempt reusing a published id -------------------------------------


def test_an_attempt_reusing_a_published_id_leaves_the_published_blob_intact(
    azure_container: str,
):
    """An attempt under a published generation's id (a bug, or a hostile caller)
    stages blocks where a committed blob already is. Neither gc (it was killed before
    committing) nor its own abort (its commit refused) may drop or replace that blob:
    ``discard_uncommitted`` commits an empty list only where no blob exists."""
    store = writer(azure_container, options=AzureOptions(block_size=MiB))
    data = bytes(range(256)) * (10 * 1024) + b"tail"  # 2.5 MiB: three blocks
    ref = publish(store, 1, {TENSOR_FILE: data})
    before = store.list_entries(ref)
    killed = store.begin_generation(ref.generation_id)
    killed.create_file(TENSOR_FILE).write(b"k" * (3 * MiB))  # staged, never committed
    assert ref.generation_id not in store.remove_stale_staging(older_than=0)
    again = store.begin_generation(ref.generation_id)
    sink = again.create_file(TENSOR_FILE)
    sink.write(b"y" * (3 * MiB + 1))
    with pytest.raises(SaveFailedError, match="already exists"):
        sink.commit()
    again.abort()
    assert store.list_generations() == [ref]
    assert store.list_entries(ref) == before
    assert digest(store.read_bytes(ref, TENSOR_FILE, 4 * MiB)) == digest(data)


# -- deleted records leave no versions behind -------------------------------------------


def test_a_deleted_record_leaves_no_earlier_versions(
    azure_container: str, monkeypatch: pytest.MonkeyPatch
):
    """With blob versioning on, deleting a record keeps its earlier versions: deletion
    marks, pins and reader leases piled up as versions, stored and billed. S3 deletes
    every version of a deleted record; Azure did not. Azurite keeps no versions, so the
    listing is made to report one and the deletes are recorded."""
    store = writer(azure_container)
    store.put_record("pinned", "g1", {"pinned": True})
    key = store.layout.record_key("pinned", "g1")
    listing = AzureClient.list_blobs
    deleted: list[tuple[str, str | None]] = []
    real_delete = AzureClient.delete

    def with_old_version(
        self: AzureClient, prefix: str, *, versions: bool = False
    ) -> Iterator[Listed]:
        yield from listing(self, prefix, versions=versions)
        if versions and prefix == key:
            yield Listed(key, 10, None, version_id="2026-01-01T00:00:00.0000000Z", is_current=False)

    def recorded(self: AzureClient, blob_key: str, version_id: str | None = None) -> None:
        deleted.append((blob_key, version_id))
        if version_id is None:
            real_delete(self, blob_key)

    monkeypatch.setattr(AzureClient, "list_blobs", with_old_version)
    monkeypatch.setattr(AzureClient, "delete", recorded)
    store.delete_record("pinned", "g1")
    assert deleted == [(key, None), (key, "2026-01-01T00:00:00.0000000Z")]
    assert store.list_records("pinned") == {}


# -- what is stored is what was sent ---------------------------------------------------


def test_a_blob_corrupted_on_the_way_is_refused_not_stored(
    azure_container: str, monkeypatch: pytest.MonkeyPatch
):
    """Staged blocks carried their MD5, but a file written in one Put Blob (smaller
    than a block), the manifest and its signature carried none: a flipped bit on the
    way was stored, and the save succeeded with bytes other than those it hashed
    (S3 puts all carry a CRC32). Every upload now carries its MD5 and the service
    refuses a mismatch."""
    from azure.core.pipeline.transport import RequestsTransport

    store = writer(azure_container)
    area = store.begin_generation(new_generation_id())
    key = store.layout.data_key(area.generation_id, TENSOR_FILE)
    real_send = RequestsTransport.send

    def flip_a_bit(self: Any, request: Any, **kwargs: Any) -> Any:
        body = request.data
        if request.method == "PUT" and key in request.url and isinstance(body, bytes) and body:
            request.data = bytes([body[0] ^ 1]) + body[1:]
        return real_send(self, request, **kwargs)

    monkeypatch.setattr(RequestsTransport, "send", flip_a_bit)
    sink = area.create_file(TENSOR_FILE)
    sink.write(b"tensor bytes" * 100)
    with pytest.raises(SaveFailedError):
        sink.commit()
    area.abort()
    assert key not in {blob.name for blob in raw_container(azure_container).list_blobs()}


# -- what held: the lease blob and records replaced with anything ------------------------


def _plant_lease(kind: str, raw: Any, key: str) -> None:
    gzipped = ContentSettings(content_encoding="gzip")
    if kind == "empty":
        raw.upload_blob(key, b"", overwrite=True)
    elif kind == "garbage":
        raw.upload_blob(key, b"\xff\xfe" * 100, overwrite=True)
    elif kind == "huge":
        raw.upload_blob(key, b"[" * (8 * MiB), overwrite=True)
    elif kind == "gzip":
        body = gzip.compress(b'{"holder":' + b" " * (8 * MiB) + b"}")
        raw.upload_blob(key, body, overwrite=True, content_settings=gzipped)
    elif kind == "page blob":
        raw.get_blob_client(key).create_page_blob(size=1 << 30)  # 1 GiB, sparse


@pytest.mark.parametrize("kind", ["empty", "garbage", "huge", "gzip", "page blob"])
def test_a_lease_blob_replaced_with_anything_is_taken_over_after_a_bounded_read(
    azure_container: str, kind: str
):
    """Nothing ckptvault writes: read at most 4 KiB of it, then replace it."""
    raw = raw_container(azure_container)
    _plant_lease(kind, raw, "run/.writer.lock")
    writer(azure_container)  # acquires: the planted blob was not a live lease
    assert raw.get_blob_client("run/.writer.lock").get_blob_properties().size < 4096


def test_records_over_the_bound_or_nested_are_never_read(azure_container: str):
    store = writer(azure_container)
    raw = raw_container(azure_container)
    prefix = store.layout.records_prefix("pinned")
    raw.upload_blob(prefix + "big.json", b'{"pinned": true, "pad": "' + b"x" * (65 * 1024) + b'"}')
    raw.upload_blob(prefix + "a/nested.json", b'{"pinned": true}')
    raw.upload_blob(prefix + "deep.json", b"[" * 5000 + b"]" * 5000)
    store.put_record("pinned", "real", {"pinned": True})
    assert store.list_records("pinned") == {"real": {"pinned": True}}
