"""What the Azure backend itself promises, on Azurite: the publish rule's primitives
as ckptvault uses them, reads pinned to what was opened, the options and URL rules,
where the account comes from, the doctor's container checks, and the one seam that
reads a store URL's scheme.

End-to-end use (CLI, tiers, retention, a killed save) is in ``test_azure.py``; the
conformance suite runs every Store behaviour on Azurite too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from ckptvault.errors import SaveFailedError, UsageError
from ckptvault.format.layout import new_generation_id
from ckptvault.ops.doctor.azure import check_azure
from ckptvault.storage import RemoteOptions, backend_of, canonical_location, local_path, open_store
from ckptvault.storage.azure.client import AzureError
from ckptvault.storage.azure.options import AzureOptions, parse_az_url
from ckptvault.storage.azure.store import AzureStore
from support.azurite_server import service_client

MiB = 1024 * 1024
SMALL_BLOCKS = AzureOptions(block_size=MiB)


OPENED: list[AzureStore] = []


@pytest.fixture(autouse=True)
def _release_writers() -> Iterator[None]:
    """Let go of every lease a test took while Azurite still runs (a lease dropped
    later would be released against a stopped service)."""
    yield
    while OPENED:
        OPENED.pop().release_writer()


def fresh_store(
    container: str, prefix: str = "run", options: AzureOptions | None = None
) -> AzureStore:
    store = AzureStore(f"az://{container}/{prefix}", options)
    store.acquire_writer()
    OPENED.append(store)
    return store


def container(name: str) -> Any:
    """The SDK's own client for container ``name`` (set-up and inspection)."""
    return service_client(os.environ["AZURE_STORAGE_CONNECTION_STRING"]).get_container_client(name)


def publish(store: AzureStore, step: int, files: dict[str, bytes]):
    area = store.begin_generation(new_generation_id())
    for name, data in files.items():
        sink = area.create_file(name)
        for start in range(0, len(data), MiB // 2):
            sink.write(data[start : start + MiB // 2])
        sink.commit()
    return area.publish(step, b'{"manifest": %d}' % step)


def test_a_large_file_is_staged_in_blocks_and_invisible_until_committed(azure_container: str):
    store = fresh_store(azure_container, options=SMALL_BLOCKS)
    area = store.begin_generation(new_generation_id())
    sink = area.create_file("r00000-000.safetensors")
    sink.write(b"x" * (3 * MiB + 5))  # three full blocks staged, the rest buffered
    key = store.layout.data_key(area.generation_id, "r00000-000.safetensors")
    raw = container(azure_container)
    assert key not in {b.name for b in raw.list_blobs(name_starts_with=store.layout.prefix)}
    sink.commit()
    blob = raw.get_blob_client(key)
    committed, _uncommitted = blob.get_block_list("all")
    assert len(committed) == 4 and blob.get_blob_properties().size == 3 * MiB + 5
    area.abort()


def test_an_attempt_reusing_a_published_id_never_touches_its_blobs(azure_container: str):
    """A save attempt under a published generation's id (a bug, or a hostile caller)
    fails at the commit; its abort must not delete the published blob it collided
    with, whose blocks it never owned."""
    store = fresh_store(azure_container, options=SMALL_BLOCKS)
    data = bytes(range(256)) * (12 * 1024)  # 3 MiB: several blocks
    ref = publish(store, 1, {"r00000-000.safetensors": data})
    again = store.begin_generation(ref.generation_id)
    sink = again.create_file("r00000-000.safetensors")
    sink.write(b"y" * (3 * MiB))
    with pytest.raises(SaveFailedError, match="already exists"):
        sink.commit()
    again.abort()
    assert store.read_bytes(ref, "r00000-000.safetensors", 10 * MiB) == data


def test_a_blob_replaced_while_it_is_read_fails_the_read(azure_container: str):
    store = fresh_store(azure_container)
    ref = publish(store, 1, {"w.bin": b"a" * (2 * MiB)})
    stream = store.open_file(ref, "w.bin")
    key = store.layout.data_key(ref.generation_id, "w.bin")
    raw = container(azure_container)
    raw.get_blob_client(key).upload_blob(b"b" * (2 * MiB), overwrite=True)
    with pytest.raises(OSError, match="replaced while it was being read"):
        stream.read()
    stream.close()


def test_immutability_is_refused_before_anything_is_uploaded_where_unsupported(
    azure_container: str,
):
    store = fresh_store(azure_container, options=AzureOptions(immutability_days=7))
    with pytest.raises(UsageError, match="version-level immutability"):
        store.begin_generation(new_generation_id())
    raw = container(azure_container)
    assert [b.name for b in raw.list_blobs(name_starts_with="run/data/")] == []


def test_a_missing_container_is_a_usage_error_naming_it(azure_env: str):
    with pytest.raises(UsageError, match="container nosuchcontainer does not exist"):
        open_store("az://nosuchcontainer/run", must_exist=True)


def test_no_account_configured_says_where_the_account_comes_from(
    monkeypatch: pytest.MonkeyPatch,
):
    for name in (
        "AZURE_STORAGE_CONNECTION_STRING",
        "AZURE_STORAGE_ACCOUNT_URL",
        "AZURE_STORAGE_ACCOUNT_NAME",
    ):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(
        UsageError, match=r"AZURE_STORAGE_CONNECTION_STRING.*AZURE_STORAGE_ACCOUNT_URL"
    ):
        open_store("az://container/run")


@pytest.mark.parametrize(
    "url",
    [
        "az://ab/x",
        "az://Upper/x",
        "az://a--b/x",
        "az://box/../x",
        "az://key@box/x",
        "az://box/x?sv=1",
    ],
)
def test_az_urls_are_validated_before_anything_is_asked(url: str):
    with pytest.raises(UsageError):
        parse_az_url(url)


def test_store_urls_have_one_canonical_form_and_only_paths_are_local(tmp_path):
    assert canonical_location("az://box/a/b/") == "az://box/a/b"
    assert canonical_location("s3://bucket/p/") == "s3://bucket/p"
    assert canonical_location(f"file://{tmp_path}") == str(tmp_path)
    assert local_path("az://box/p") is None and local_path(str(tmp_path)) == tmp_path
    assert [backend_of(x) for x in ("az://box", "s3://bucket", str(tmp_path))] == [
        "azure",
        "s3",
        "posix",
    ]
    with pytest.raises(UsageError, match="unsupported store URL scheme 'gs'"):
        backend_of("gs://bucket/p")


def test_each_backend_takes_only_its_own_options():
    given = RemoteOptions.from_keywords(object_lock_days=7)
    assert given.for_location("az://box/p") == {"azure": AzureOptions(immutability_days=7)}
    assert "s3" in given.for_location("s3://bucket/p")
    given.check_used_by("az://box/p")  # lock days apply to az:// as well
    endpoint = RemoteOptions.from_keywords(s3_endpoint_url="http://127.0.0.1:9")
    with pytest.raises(UsageError, match="apply to s3:// stores only"):
        endpoint.check_used_by("az://box/p", None)
    with pytest.raises(UsageError, match="Azure options apply to az:// stores only"):
        open_store("s3://bucket/p", azure=AzureOptions())


def test_doctor_fails_a_public_container_and_warns_about_an_account_key(azure_container: str):
    store = fresh_store(azure_container)
    publish(store, 1, {"w.bin": b"w"})
    findings = {f.check: f for f in check_azure(store)}
    assert findings["container public access"].status == "ok"
    assert findings["Azure credentials"].status == "warn"  # Azurite's account key
    assert findings["blob versioning"].status == "warn"  # Azurite keeps no versions
    raw = container(azure_container)
    raw.set_container_access_policy(signed_identifiers={}, public_access="container")
    public = {f.check: f for f in check_azure(store)}["container public access"]
    assert public.status == "fail" and "--public-access off" in public.fix


def _crashed_attempt(store: AzureStore) -> str:
    """An attempt whose writer died with blocks staged and nothing committed."""
    area = store.begin_generation(new_generation_id())
    sink = area.create_file("r00000-000.safetensors")
    sink.write(b"z" * (2 * MiB))  # two 1 MiB blocks staged, never committed
    for block in sink._blocks:  # the uploads finish; the writer then "dies"
        block.result()
    return area.generation_id


def test_one_attempt_that_cannot_be_removed_does_not_stop_the_cleanup_pass(
    azure_container: str, monkeypatch: pytest.MonkeyPatch
):
    store = fresh_store(azure_container, options=SMALL_BLOCKS)
    stuck, other = sorted([_crashed_attempt(store), _crashed_attempt(store)])
    discard = store.client.discard_uncommitted

    def refuse_the_first(key: str) -> None:
        if stuck in key:
            raise AzureError(13, f"deleting {key}: AuthorizationFailure", "AuthorizationFailure")
        discard(key)

    monkeypatch.setattr(store.client, "discard_uncommitted", refuse_the_first)
    assert store.remove_stale_staging(older_than=0) == [other]
    staged = store.client.list_uncommitted(store.layout.data_root)
    assert [item.key for item in staged if other in item.key] == []
    assert [item.key for item in staged if stuck in item.key] != []
