"""The one place ckptvault talks to boto3: client creation and error translation.

boto3 is imported lazily, here only, so that a local store never loads it, and a
missing boto3 is a :class:`UsageError` that says how to install it. Every S3 call
goes through :meth:`S3Client.call`, which turns boto3's exceptions into
:class:`S3Error` — an ``OSError``, so the restore checks report a failed read as
``unreadable`` and a missing object (:class:`S3NotFound`, a ``FileNotFoundError``)
the way they report a missing file — with the operation and the ``s3://`` URL in
the message. A refused condition (``If-None-Match``/``If-Match``) is
:class:`S3PreconditionFailed`, which callers handle as "someone else got there first".
"""

from __future__ import annotations

import errno
from collections.abc import Iterator
from typing import Any

from ckptvault.aws import boto3_session
from ckptvault.errors import UsageError
from ckptvault.storage.objects.errors import (
    ObjectNotFound,
    ObjectPreconditionFailed,
    ObjectStoreError,
)
from ckptvault.storage.s3.options import S3Location, S3Options

DELETE_BATCH = 1000  # S3's limit for one DeleteObjects request
CHECKSUM = "CRC32"  # verified by S3 on every PUT and part upload


class S3Error(ObjectStoreError):
    """An S3 request failed; ``code`` is S3's error code (or the client's error name)."""


class S3NotFound(S3Error, ObjectNotFound):
    """The object, upload or bucket does not exist."""


class S3PreconditionFailed(S3Error, ObjectPreconditionFailed):
    """A conditional request lost: the object exists (``If-None-Match``) or changed
    (``If-Match``)."""


_NOT_FOUND = {"NoSuchKey", "NotFound", "404", "NoSuchUpload", "NoSuchBucket"}
_DENIED = {"AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch"}


def _boto_errors() -> tuple[type[Exception], ...]:
    import botocore.exceptions

    return (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError)


# What to check when boto3 had no answer from S3 because of the environment, by the
# botocore exception's name: where boto3 looks, and how ckptvault names the endpoint.
_CREDENTIALS = (
    "boto3 found no usable AWS credentials; it looks, in order, at the environment "
    "(AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, with AWS_SESSION_TOKEN for temporary "
    "ones), the profile AWS_PROFILE names (else [default]) in ~/.aws/credentials and "
    "~/.aws/config (AWS_SHARED_CREDENTIALS_FILE, AWS_CONFIG_FILE move them), and the "
    "instance or container metadata service (an IAM role)"
)
_ENDPOINT = (
    "the endpoint is s3_endpoint_url= (--s3-endpoint-url) or AWS_ENDPOINT_URL, else AWS's "
    "own for the region"
)
_HINTS = {
    "NoCredentialsError": _CREDENTIALS,
    "PartialCredentialsError": _CREDENTIALS,
    "CredentialRetrievalError": _CREDENTIALS,
    "NoRegionError": "set AWS_DEFAULT_REGION (or region in the profile's ~/.aws/config)",
    "EndpointConnectionError": "nothing answered at the endpoint: check it",
    "ConnectTimeoutError": "nothing answered at the endpoint: check it",
}


def translate(exc: Exception, what: str, endpoint: str | None = None) -> S3Error:
    """``exc`` (a boto3 exception) as an :class:`S3Error` saying ``what`` failed (at
    ``endpoint``, when known); an error of the environment (credentials, region, an
    endpoint that does not answer) says where boto3 looks for what is missing."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):  # no answer from S3: network, credentials
        name = type(exc).__name__
        hint = _HINTS.get(name)
        if hint is None:
            return S3Error(errno.EIO, f"{what}: {name}: {exc}", name)
        used = f" (now {endpoint})" if endpoint else ""
        return S3Error(errno.EIO, f"{what}: {exc} ({name}): {hint}; {_ENDPOINT}{used}", name)
    error = response.get("Error") or {}
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    code = str(error.get("Code") or status or "unknown")
    message = f"{what}: {code} ({error.get('Message') or status})"
    if code == "PreconditionFailed" or status == 412:
        return S3PreconditionFailed(errno.EEXIST, message, "PreconditionFailed")
    if code in _NOT_FOUND or status == 404:
        return S3NotFound(errno.ENOENT, message, code)
    if code in _DENIED or status == 403:
        return S3Error(errno.EACCES, message, code)
    return S3Error(errno.EIO, message, code)


def make_boto3_client(options: S3Options) -> Any:
    """A boto3 S3 client configured from boto3's defaults plus ``options``."""
    try:
        from botocore.config import Config

        session = boto3_session()
    except ImportError as exc:
        raise UsageError(
            "s3:// stores need boto3, which is not installed: pip install ckptvault[s3]"
        ) from exc
    config = Config(
        # Uploads, read-ahead, listing and the lease renewal share the pool.
        max_pool_connections=2 * options.max_concurrency + 4,
        retries={"mode": "standard", "max_attempts": 5},
        connect_timeout=20,
        read_timeout=120,
    )
    return session.client("s3", endpoint_url=options.endpoint_url, config=config)


class S3Client:
    """A boto3 client bound to one bucket, raising :class:`S3Error` only."""

    def __init__(self, location: S3Location, options: S3Options) -> None:
        self.bucket = location.bucket
        self.raw = make_boto3_client(options)

    def url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def translate(self, exc: Exception, what: str) -> S3Error:
        endpoint = getattr(getattr(self.raw, "meta", None), "endpoint_url", None)
        return translate(exc, what, endpoint if isinstance(endpoint, str) else None)

    def call(self, operation: str, key: str | None = None, **params: Any) -> dict[str, Any]:
        """``operation`` (a boto3 client method name) on ``key`` of this bucket."""
        if key is not None:
            params["Key"] = key
        try:
            result: dict[str, Any] = getattr(self.raw, operation)(Bucket=self.bucket, **params)
        except _boto_errors() as exc:
            where = self.url(key) if key is not None else f"s3://{self.bucket}"
            raise self.translate(exc, f"{operation} {where}") from exc
        return result

    def get_bytes(self, key: str, **params: Any) -> tuple[bytes, dict[str, Any]]:
        """The body of a GET (whole or ``Range=``) and the response's metadata."""
        response = self.call("get_object", key, **params)
        try:
            return response["Body"].read(), response
        except _boto_errors() as exc:
            raise self.translate(exc, f"reading {self.url(key)}") from exc
        finally:
            response["Body"].close()

    def list_objects(self, prefix: str) -> Iterator[dict[str, Any]]:
        """Every object under ``prefix`` (``Key``, ``Size``, ``LastModified``), paginated."""
        paginator = self.raw.get_paginator("list_objects_v2")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                yield from page.get("Contents", ())
        except _boto_errors() as exc:
            raise self.translate(exc, f"listing {self.url(prefix)}") from exc

    def list_uploads(self, prefix: str) -> Iterator[dict[str, Any]]:
        """Incomplete multipart uploads under ``prefix`` (``Key``, ``UploadId``, ``Initiated``)."""
        paginator = self.raw.get_paginator("list_multipart_uploads")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                yield from page.get("Uploads", ())
        except _boto_errors() as exc:
            raise self.translate(exc, f"listing uploads under {self.url(prefix)}") from exc

    def list_parts(self, key: str, upload_id: str) -> Iterator[dict[str, Any]]:
        paginator = self.raw.get_paginator("list_parts")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Key=key, UploadId=upload_id):
                yield from page.get("Parts", ())
        except _boto_errors() as exc:
            raise self.translate(exc, f"listing the parts of an upload to {self.url(key)}") from exc

    def delete_keys(self, keys: list[str]) -> None:
        """Delete ``keys`` in batches of at most 1000; already missing is fine."""
        for start in range(0, len(keys), DELETE_BATCH):
            batch = keys[start : start + DELETE_BATCH]
            response = self.call(
                "delete_objects",
                Delete={"Objects": [{"Key": key} for key in batch], "Quiet": True},
            )
            failed = [e for e in response.get("Errors", ()) if e.get("Code") != "NoSuchKey"]
            if failed:
                first = failed[0]
                raise S3Error(
                    errno.EIO,
                    f"deleting {self.url(first.get('Key', '?'))}: {first.get('Code')} "
                    f"({first.get('Message')}); {len(failed)} of {len(batch)} objects not deleted",
                    str(first.get("Code")),
                )

    def list_versions(self, prefix: str) -> Iterator[dict[str, Any]]:
        """Every version and delete marker under ``prefix`` (``Key``, ``VersionId``,
        ``IsLatest``; delete markers with ``DeleteMarker: True``), paginated."""
        paginator = self.raw.get_paginator("list_object_versions")
        try:
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                yield from page.get("Versions", ())
                for marker in page.get("DeleteMarkers", ()):
                    yield {**marker, "DeleteMarker": True}
        except _boto_errors() as exc:
            raise self.translate(exc, f"listing the versions under {self.url(prefix)}") from exc

    def delete_versions(self, versions: list[tuple[str, str]]) -> dict[str, str]:
        """Delete ``(key, version id)`` pairs in batches of at most 1000; returns, by
        key, why a version was not deleted (``AccessDenied (...)``), never raising for
        that: the caller lists again to learn what stayed."""
        refused: dict[str, str] = {}
        for start in range(0, len(versions), DELETE_BATCH):
            batch = versions[start : start + DELETE_BATCH]
            response = self.call(
                "delete_objects",
                Delete={
                    "Objects": [{"Key": key, "VersionId": version} for key, version in batch],
                    "Quiet": True,
                },
            )
            for error in response.get("Errors", ()):
                if error.get("Code") not in ("NoSuchKey", "NoSuchVersion"):
                    refused[str(error.get("Key"))] = f"{error.get('Code')} ({error.get('Message')})"
        return refused

    def put_new(
        self, key: str, data: bytes | bytearray, *, accept_identical: bool = False, **params: Any
    ) -> dict[str, Any]:
        """Create ``key`` holding ``data`` only if it does not exist (``If-None-Match``);
        :class:`S3PreconditionFailed` when it does.

        ``accept_identical``: an existing object holding exactly ``data`` counts as
        success. For the manifest, where it is this very write retried by boto3 after a
        lost response; treating that as a lost race would abort a published generation.
        (Data objects never accept: a save that abandons its attempt deletes what it
        wrote, so it must never count someone else's object as its own.)
        """
        try:
            return self.call(
                "put_object", key, Body=data, IfNoneMatch="*", ChecksumAlgorithm=CHECKSUM, **params
            )
        except S3PreconditionFailed:
            if accept_identical and self.holds_exactly(key, data) is True:
                return {}
            raise

    def holds_exactly(self, key: str, data: bytes | bytearray) -> bool | None:
        """Whether ``key`` holds exactly ``data``: True, False (absent or different),
        or None when S3 could not be asked."""
        try:
            if not data:
                return int(self.call("head_object", key).get("ContentLength", -1)) == 0
            existing, response = self.get_bytes(key, Range=f"bytes=0-{len(data)}")
        except S3NotFound:
            return False
        except S3Error as exc:
            return False if exc.code == "InvalidRange" else None  # InvalidRange: it is empty
        return existing == data and _total_size(response) == len(data)


def _total_size(response: dict[str, Any]) -> int:
    """The object's full size from a ranged GET's ``Content-Range`` (``bytes a-b/N``)."""
    total = str(response.get("ContentRange") or "").rpartition("/")[2]
    return int(total) if total.isdigit() else -1
