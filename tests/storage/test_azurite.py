"""The Azurite fixture, and the service primitives the Azure backend's publish rule
stands on, as the emulator the suite runs against provides them: a blob created only
if absent, blocks staged and invisible until one commit, uncommitted blocks that a
listing can find and a delete can remove."""

from __future__ import annotations

import pytest

from support.azurite_server import new_container, service_client


def test_a_fresh_container_is_empty_and_holds_what_is_written(azurite_endpoint: str) -> None:
    name = new_container(azurite_endpoint)
    container = service_client(azurite_endpoint).get_container_client(name)
    assert list(container.list_blobs()) == []
    container.upload_blob("a/b.bin", b"payload")
    assert [b.name for b in container.list_blobs()] == ["a/b.bin"]
    assert container.download_blob("a/b.bin").readall() == b"payload"
    assert name in {c.name for c in service_client(azurite_endpoint).list_containers()}


def test_create_if_absent_refuses_a_second_writer(azurite_endpoint: str) -> None:
    from azure.core.exceptions import ResourceExistsError

    container = service_client(azurite_endpoint).get_container_client(
        new_container(azurite_endpoint)
    )
    container.upload_blob("manifest", b"first", overwrite=False)
    with pytest.raises(ResourceExistsError):
        container.upload_blob("manifest", b"second", overwrite=False)
    blob = container.get_blob_client("manifest")
    blob.stage_block("b0", b"third")
    with pytest.raises(ResourceExistsError):
        blob.commit_block_list(["b0"], if_none_match="*")
    assert container.download_blob("manifest").readall() == b"first"


def test_staged_blocks_are_invisible_until_committed_and_deletable_before(
    azurite_endpoint: str,
) -> None:
    container = service_client(azurite_endpoint).get_container_client(
        new_container(azurite_endpoint)
    )
    blob = container.get_blob_client("data/part")
    blob.stage_block("b0", b"staged")
    assert [b.name for b in container.list_blobs()] == []
    listed = list(container.list_blobs(include=["uncommittedblobs"]))
    assert [b.name for b in listed] == ["data/part"]
    blob.delete_blob()
    assert list(container.list_blobs(include=["uncommittedblobs"])) == []

    blob.stage_block("b1", b"again")
    blob.commit_block_list(["b1"], if_none_match="*")
    assert container.download_blob("data/part").readall() == b"again"
