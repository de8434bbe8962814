"""The S3 primitives the S3 store's publish rule stands on, on moto and on SeaweedFS.

The store publishes a generation by one ``If-None-Match: *`` write of its manifest,
never replaces a data object (``If-None-Match: *`` on PutObject and on
CompleteMultipartUpload), renews its writer lease with ``If-Match``, reads ranges
pinned to an ETag, sends a CRC32 with every PUT and part, and cleans up by listing
and aborting uploads. Each test checks one of those on each server with a plain
boto3 client (``each_s3_endpoint``); where a server does not do what AWS S3
documents, the case is skipped there with what was measured (docs/guides/storage.md's "S3
on a real server" lists them).
"""

from __future__ import annotations

import base64
import secrets
import zlib
from typing import Any

import pytest
from botocore.exceptions import ClientError

from support.s3_server import new_bucket, s3_client
from support.seaweedfs_server import s3_server_of

PART = 5 * 1024 * 1024  # S3's smallest part but the last


@pytest.fixture
def raw(each_s3_endpoint: str) -> tuple[Any, str]:
    """A plain client and a fresh bucket on the server under test."""
    return s3_client(each_s3_endpoint), new_bucket(each_s3_endpoint)


def error_code(call: Any, **params: Any) -> str:
    with pytest.raises(ClientError) as raised:
        call(**params)
    return str(raised.value.response["Error"]["Code"])


def body(client: Any, bucket: str, key: str) -> bytes:
    return bytes(client.get_object(Bucket=bucket, Key=key)["Body"].read())


def complete(client: Any, bucket: str, key: str, data: bytes, **condition: Any) -> Any:
    upload = client.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32")
    part = client.upload_part(
        Bucket=bucket, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=data,
        ChecksumAlgorithm="CRC32",
    )  # fmt: skip
    parts = [{"PartNumber": 1, "ETag": part["ETag"], "ChecksumCRC32": part["ChecksumCRC32"]}]
    return client.complete_multipart_upload(
        Bucket=bucket, Key=key, UploadId=upload["UploadId"],
        MultipartUpload={"Parts": parts}, **condition,
    )  # fmt: skip


def test_put_if_none_match_never_replaces_an_object(raw: tuple[Any, str]):
    client, bucket = raw
    client.put_object(Bucket=bucket, Key="k", Body=b"first", IfNoneMatch="*")
    code = error_code(client.put_object, Bucket=bucket, Key="k", Body=b"second", IfNoneMatch="*")
    assert code == "PreconditionFailed"
    assert body(client, bucket, "k") == b"first"


def test_complete_multipart_if_none_match_never_replaces_an_object(raw: tuple[Any, str]):
    client, bucket = raw
    complete(client, bucket, "m", b"a" * PART, IfNoneMatch="*")
    with pytest.raises(ClientError) as raised:
        complete(client, bucket, "m", b"b" * PART, IfNoneMatch="*")
    assert raised.value.response["Error"]["Code"] == "PreconditionFailed"
    assert body(client, bucket, "m")[:1] == b"a"


def test_put_if_match_replaces_only_the_object_it_names(raw: tuple[Any, str], request):
    client, bucket = raw
    first = client.put_object(Bucket=bucket, Key="lease", Body=b"one")["ETag"]
    second = client.put_object(Bucket=bucket, Key="lease", Body=b"two", IfMatch=first)["ETag"]
    stale = error_code(client.put_object, Bucket=bucket, Key="lease", Body=b"3", IfMatch=first)
    assert stale == "PreconditionFailed" and body(client, bucket, "lease") == b"two"
    missing = error_code(client.put_object, Bucket=bucket, Key="gone", Body=b"x", IfMatch=second)
    # Measured: SeaweedFS 412 PreconditionFailed, moto 404 NoSuchKey (which AWS
    # documents). The lease takes either as "lost" (ObjectPreconditionFailed and
    # ObjectNotFound alike).
    expected = "PreconditionFailed" if s3_server_of(request) == "seaweedfs" else "NoSuchKey"
    assert missing == expected


def test_a_read_pinned_to_a_replaced_objects_etag_is_refused(raw: tuple[Any, str]):
    client, bucket = raw
    etag = client.put_object(Bucket=bucket, Key="w", Body=b"old bytes")["ETag"]
    client.put_object(Bucket=bucket, Key="w", Body=b"new bytes")
    code = error_code(client.get_object, Bucket=bucket, Key="w", IfMatch=etag, Range="bytes=0-2")
    assert code == "PreconditionFailed"


def test_a_wrong_crc32_is_refused_and_nothing_is_stored(raw: tuple[Any, str], request):
    if s3_server_of(request) == "moto":
        pytest.skip(
            "moto 5.2.5 does not check checksums (measured: it stores a PUT and a part "
            "whose ChecksumCRC32 is wrong); AWS S3 and SeaweedFS answer BadDigest"
        )
    client, bucket = raw
    data = b"checksummed bytes"
    right = base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()
    assert client.put_object(Bucket=bucket, Key="c", Body=data, ChecksumCRC32=right)[
        "ChecksumCRC32"
    ] == right  # fmt: skip
    wrong = {"Body": data, "ChecksumCRC32": "AAAAAA=="}
    assert error_code(client.put_object, Bucket=bucket, Key="bad", **wrong) == "BadDigest"
    assert error_code(client.head_object, Bucket=bucket, Key="bad") == "404"
    upload = client.create_multipart_upload(Bucket=bucket, Key="p", ChecksumAlgorithm="CRC32")
    part = {"UploadId": upload["UploadId"], "PartNumber": 1, "Body": b"x" * PART}
    code = error_code(client.upload_part, Bucket=bucket, Key="p", ChecksumCRC32="AAAAAA==", **part)
    assert code == "BadDigest"
    client.abort_multipart_upload(Bucket=bucket, Key="p", UploadId=upload["UploadId"])


def test_an_aborted_upload_is_no_longer_listed_nor_usable(raw: tuple[Any, str]):
    client, bucket = raw
    upload = client.create_multipart_upload(Bucket=bucket, Key="data/x")["UploadId"]
    client.upload_part(Bucket=bucket, Key="data/x", UploadId=upload, PartNumber=1, Body=b"x")
    listed = client.list_multipart_uploads(Bucket=bucket, Prefix="data/")["Uploads"]
    assert [(u["Key"], u["UploadId"]) for u in listed] == [("data/x", upload)]
    assert listed[0]["Initiated"]  # what cleanup's age test reads
    client.abort_multipart_upload(Bucket=bucket, Key="data/x", UploadId=upload)
    assert not client.list_multipart_uploads(Bucket=bucket, Prefix="data/").get("Uploads")
    gone = error_code(client.list_parts, Bucket=bucket, Key="data/x", UploadId=upload)
    assert gone == "NoSuchUpload"
    assert error_code(client.head_object, Bucket=bucket, Key="data/x") == "404"


def test_listing_shows_each_write_and_delete_at_once(raw: tuple[Any, str]):
    client, bucket = raw

    def listed() -> set[str]:
        found = client.list_objects_v2(Bucket=bucket, Prefix="l/").get("Contents", [])
        return {str(o["Key"]) for o in found}

    keys = [f"l/{secrets.token_hex(4)}" for _ in range(20)]
    for done, key in enumerate(keys, 1):
        client.put_object(Bucket=bucket, Key=key, Body=b"x")
        assert listed() == set(keys[:done])
    for done, key in enumerate(keys, 1):
        client.delete_object(Bucket=bucket, Key=key)
        assert listed() == set(keys[done:])
