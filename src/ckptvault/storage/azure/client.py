"""The one place ckptvault talks to the Azure SDK: client creation, the few blob
operations the store needs, and error translation.

The SDK is imported here only, lazily, so a local or S3 store never loads it, and a
missing SDK is a :class:`UsageError` that says how to install it. Every call raises
:class:`AzureError` (an ``OSError``) and nothing else: :class:`AzureNotFound` (a
``FileNotFoundError``) for a missing blob or container, :class:`AzurePreconditionFailed`
when a condition (``If-None-Match: *``, ``If-Match: <ETag>``) refused the write —
"someone else got there first".
"""

from __future__ import annotations

import base64
import contextlib
import email.utils
import errno
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, TypeVar

from ckptvault.errors import UsageError
from ckptvault.storage.azure.options import AzureLocation, AzureOptions
from ckptvault.storage.objects.errors import (
    ObjectNotFound,
    ObjectPreconditionFailed,
    ObjectStoreError,
)

T = TypeVar("T")

CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
ACCOUNT_URL = "AZURE_STORAGE_ACCOUNT_URL"
ACCOUNT_NAME = "AZURE_STORAGE_ACCOUNT_NAME"
_WHERE = (
    f"the account comes from {CONNECTION_STRING}, else an account URL (account_url=, "
    f"{ACCOUNT_URL}, or {ACCOUNT_NAME}) with DefaultAzureCredential (AZURE_CLIENT_ID/"
    "AZURE_TENANT_ID/AZURE_CLIENT_SECRET, a workload or managed identity, or `az login`)"
)


class AzureError(ObjectStoreError):
    """An Azure Blob request failed; ``code`` is the service's error code."""


class AzureNotFound(AzureError, ObjectNotFound):
    """The blob or container does not exist."""


class AzurePreconditionFailed(AzureError, ObjectPreconditionFailed):
    """A conditional request lost: the blob exists or changed."""


_NOT_FOUND = {"BlobNotFound", "ContainerNotFound", "ResourceNotFound"}
_EXISTS = {"BlobAlreadyExists", "ConditionNotMet", "TargetConditionNotMet"}
_DENIED = {"AuthorizationFailure", "AuthenticationFailed", "AuthorizationPermissionMismatch"}


def translate(exc: Exception, what: str) -> AzureError:
    """An SDK exception as an :class:`AzureError` saying ``what`` failed."""
    status = getattr(exc, "status_code", None)
    raw = getattr(exc, "error_code", None)  # a str, or the SDK's StorageErrorCode enum
    code = str(getattr(raw, "value", raw) or status or type(exc).__name__)
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    message = f"{what}: {code} ({first_line[:300]})"
    if status == 412 or code in _EXISTS or (status == 409 and code == "BlobAlreadyExists"):
        return AzurePreconditionFailed(errno.EEXIST, message, code)
    if status == 404 or code in _NOT_FOUND:
        return AzureNotFound(errno.ENOENT, message, code)
    if status == 403 or code in _DENIED:
        return AzureError(errno.EACCES, f"{message}; {_WHERE}", code)
    if status is None and type(exc).__name__ in (
        "ClientAuthenticationError",
        "CredentialUnavailableError",
    ):
        return AzureError(errno.EACCES, f"{message}; {_WHERE}", code)
    return AzureError(errno.EIO, message, code)


def _sdk_errors() -> tuple[type[Exception], ...]:
    from azure.core.exceptions import AzureError as SdkError

    return (SdkError,)


def make_service_client(location: AzureLocation, options: AzureOptions) -> Any:
    """The SDK's ``BlobServiceClient`` for the account of ``location``, from the
    environment (see :mod:`ckptvault.storage.azure.options`)."""
    try:
        from azure.storage.blob import BlobServiceClient
    except ImportError as exc:
        raise UsageError(
            "az:// stores need azure-storage-blob, which is not installed: "
            "pip install 'ckptvault[azure]'"
        ) from exc
    from azure.storage.blob import ExponentialRetry

    settings: dict[str, Any] = {
        "max_single_put_size": 64 * 1024 * 1024,
        "connection_timeout": 20,
        # The SDK's default waits 15 s, then 18 s, 24 s: a lease renewal or a release
        # against an endpoint that went away would stall a minute. 1, 3, 5, 9, 17 s.
        "retry_policy": ExponentialRetry(initial_backoff=1, increment_base=2, retry_total=5),
    }
    connection = os.environ.get(CONNECTION_STRING)
    if connection and options.account_url is None:
        try:
            return BlobServiceClient.from_connection_string(connection, **settings)
        except ValueError as exc:
            raise UsageError(
                f"{CONNECTION_STRING} is not a valid connection string: {exc}"
            ) from exc
    url = options.account_url or os.environ.get(ACCOUNT_URL)
    name = os.environ.get(ACCOUNT_NAME)
    if not url and name:
        url = f"https://{name}.blob.core.windows.net"
    if not url:
        raise UsageError(
            f"no Azure storage account is configured for az://{location.container}: {_WHERE}"
        )
    try:
        from azure.identity import DefaultAzureCredential
    except ImportError as exc:
        raise UsageError(
            "an account URL without a connection string needs azure-identity: "
            "pip install 'ckptvault[azure]'"
        ) from exc
    return BlobServiceClient(url, credential=DefaultAzureCredential(), **settings)


@dataclass(frozen=True)
class BlobHead:
    """What a blob's properties say: size, version (ETag), last write, holds."""

    key: str
    size: int
    etag: str
    last_modified: datetime | None
    version_id: str | None = None
    immutable_until: datetime | None = None
    immutable_mode: str | None = None  # "Unlocked" or "Locked"
    legal_hold: bool = False


@dataclass(frozen=True)
class Listed:
    """One blob of a listing (``uncommitted``: staged blocks, never committed)."""

    key: str
    size: int
    last_modified: datetime | None
    version_id: str | None = None
    is_current: bool = True
    uncommitted: bool = False


# Every download serves the bytes stored. The SDK inflates a blob whose
# Content-Encoding says gzip or deflate by default, in memory and before any bound of
# ours applies: a 64 KiB record planted with that header became 64 MiB, an 8 MiB range
# up to 8 GiB, and the bytes read were not the bytes stored.
STORED_BYTES: dict[str, Any] = {"decompress": False}
# Every upload carries the MD5 of its bytes, which the service checks on arrival (as
# every staged block does, and as S3 puts carry a CRC32): a blob written in one Put
# Blob (a small data file, the manifest, its signature) is never stored other than sent.
CHECKED: dict[str, Any] = {"validate_content": True}


def addressable(key: str) -> bool:
    """Whether a request for blob ``key`` reaches that blob. The service keeps a name
    such as ``run/data/x/../../victim`` as it is (whoever can write the container can
    plant one), but the HTTP layer below the SDK resolves a path's ``.`` and ``..``
    segments: a request for that listed name would reach ``victim``, outside the
    store. ckptvault never makes such names; it never sends one either."""
    return not any(part in (".", "..") for part in key.split("/"))


def block_id(index: int) -> str:
    """The id of block ``index`` of a blob: every id of a blob has the same length."""
    return base64.b64encode(f"ckptvault-block-{index:08d}".encode()).decode()


class AzureClient:
    """A container client bound to one container, raising :class:`AzureError` only."""

    def __init__(self, location: AzureLocation, options: AzureOptions) -> None:
        self.container = location.container
        self.service = make_service_client(location, options)
        self.raw = self.service.get_container_client(location.container)

    def url(self, key: str) -> str:
        return f"az://{self.container}/{key}"

    def call(self, what: str, operation: Callable[[], T]) -> T:
        """Run ``operation`` (SDK calls), its errors translated with ``what`` in the message."""
        try:
            return operation()
        except _sdk_errors() as exc:
            raise translate(exc, what) from exc

    def blob(self, key: str) -> Any:
        """The SDK's client for ``key``; :class:`AzureError` for a name no request can
        address safely (:func:`addressable`)."""
        if not addressable(key):
            raise AzureError(
                errno.EINVAL,
                f"{self.url(key)}: a blob name with '.' or '..' segments is not one ckptvault "
                "writes, and a request for it would reach another blob; it is left alone",
                "UnaddressableName",
            )
        return self.raw.get_blob_client(key)

    # -- the container -------------------------------------------------------------

    def container_exists(self) -> bool:
        return self.call(f"asking for container {self.container}", self.raw.exists)

    def server_now(self) -> float:
        """The service's clock (a response's ``Date``, to the end of its second)."""
        headers: dict[str, str] = {}

        def keep(response: Any) -> None:
            headers.update(response.http_response.headers)

        self.call(
            f"reading az://{self.container}",
            lambda: self.raw.get_container_properties(raw_response_hook=keep),
        )
        return _date_of(headers) + 1.0

    # -- writing -------------------------------------------------------------------

    def put_new(
        self, key: str, data: bytes | bytearray, *, accept_identical: bool = False, **params: Any
    ) -> str:
        """Create ``key`` holding ``data`` only if it does not exist (``If-None-Match: *``);
        its ETag. :class:`AzurePreconditionFailed` when it exists, unless
        ``accept_identical`` and it holds exactly ``data`` (this very write, retried
        after a lost response)."""
        blob = self.blob(key)
        try:
            result = self.call(
                f"writing {self.url(key)}",
                lambda: blob.upload_blob(bytes(data), overwrite=False, **CHECKED, **params),
            )
        except AzurePreconditionFailed:
            if accept_identical and self.holds_exactly(key, data) is True:
                return self.head(key).etag
            raise
        return str(result["etag"])

    def put_if_match(self, key: str, data: bytes, etag: str, **params: Any) -> str:
        """Overwrite ``key`` only while its ETag is ``etag``; the new ETag."""
        from azure.core import MatchConditions

        blob = self.blob(key)
        result = self.call(
            f"replacing {self.url(key)}",
            lambda: blob.upload_blob(
                data,
                overwrite=True,
                **CHECKED,
                etag=etag,
                match_condition=MatchConditions.IfNotModified,
                **params,
            ),
        )
        return str(result["etag"])

    def put(self, key: str, data: bytes, **params: Any) -> None:
        """Create or replace ``key`` (records: small, replaced whole)."""
        blob = self.blob(key)
        self.call(
            f"writing {self.url(key)}",
            lambda: blob.upload_blob(data, overwrite=True, **CHECKED, **params),
        )

    def stage_block(self, key: str, index: int, data: bytes | bytearray) -> None:
        """Upload block ``index`` of ``key``, uncommitted (invisible until committed);
        the service checks the bytes against their MD5."""
        blob = self.blob(key)
        self.call(
            f"uploading block {index} of {self.url(key)}",
            lambda: blob.stage_block(block_id(index), bytes(data), validate_content=True),
        )

    def commit_blocks(self, key: str, count: int, **params: Any) -> str:
        """Make blocks ``0..count-1`` the blob ``key``, only if it does not exist; its ETag."""
        blob = self.blob(key)
        ids = [block_id(index) for index in range(count)]
        result = self.call(
            f"committing {self.url(key)}",
            # if_none_match, not etag/match_condition: the SDK's commit passes an
            # IfMissing condition's etag through to the transport.
            lambda: blob.commit_block_list(ids, if_none_match="*", **params),
        )
        return str(result["etag"])

    def discard_uncommitted(self, key: str) -> None:
        """Drop the staged blocks of ``key`` when no blob was ever committed there.
        Azure has no call for that: committing an empty block list where no blob
        exists (``If-None-Match: *``) discards them, and that empty blob is then
        deleted while it is still the one just made. A committed blob (a published
        generation's, when an attempt reused its id) is never touched; blocks staged
        beside it are dropped by Azure after a week."""
        from azure.core import MatchConditions

        try:
            etag = self.commit_blocks(key, 0)
        except AzurePreconditionFailed:
            return  # a committed blob is there: not ours to drop
        blob = self.blob(key)
        with contextlib.suppress(AzureNotFound, AzurePreconditionFailed):
            self.call(
                f"deleting {self.url(key)}",
                lambda: blob.delete_blob(etag=etag, match_condition=MatchConditions.IfNotModified),
            )

    def delete(self, key: str, version_id: str | None = None) -> None:
        """Delete ``key`` (that version); already missing is fine."""
        blob = self.blob(key)
        params = {"version_id": version_id} if version_id else {}
        with contextlib.suppress(AzureNotFound):
            self.call(f"deleting {self.url(key)}", lambda: blob.delete_blob(**params))

    # -- reading -------------------------------------------------------------------

    def head(self, key: str, version_id: str | None = None) -> BlobHead:
        blob = self.blob(key)
        params = {"version_id": version_id} if version_id else {}
        props = self.call(f"reading {self.url(key)}", lambda: blob.get_blob_properties(**params))
        policy = getattr(props, "immutability_policy", None)
        return BlobHead(
            key=key,
            size=int(props.size),
            etag=str(props.etag),
            last_modified=props.last_modified,
            version_id=getattr(props, "version_id", None),
            immutable_until=getattr(policy, "expiry_time", None),
            immutable_mode=getattr(policy, "policy_mode", None),
            legal_hold=bool(getattr(props, "has_legal_hold", False)),
        )

    def get_range(self, key: str, offset: int, length: int, etag: str | None = None) -> bytes:
        """``length`` bytes from ``offset`` (fewer at the end); with ``etag``, only
        from that version (:class:`AzurePreconditionFailed` once it changed)."""
        from azure.core import MatchConditions

        blob = self.blob(key)
        params: dict[str, Any] = dict(STORED_BYTES)
        if etag is not None:
            params.update(etag=etag, match_condition=MatchConditions.IfNotModified)
        return self.call(
            f"reading {self.url(key)}",
            lambda: blob.download_blob(offset=offset, length=length, **params).readall(),
        )

    def get_with_age(self, key: str, limit: int) -> tuple[bytes, int, str, float]:
        """The first ``limit`` bytes of ``key``, its size, ETag and age by the
        service's clock (``Date`` minus ``Last-Modified``)."""
        blob = self.blob(key)
        headers: dict[str, str] = {}

        def keep(response: Any) -> None:
            headers.update(response.http_response.headers)

        def download() -> tuple[bytes, Any]:
            stream = blob.download_blob(
                offset=0, length=limit, raw_response_hook=keep, **STORED_BYTES
            )
            return stream.readall(), stream.properties

        raw, props = self.call(f"reading {self.url(key)}", download)
        age = _date_of(headers) - props.last_modified.timestamp() if props.last_modified else 0.0
        return raw, int(props.size), str(props.etag), age

    def holds_exactly(self, key: str, data: bytes | bytearray) -> bool | None:
        """Whether ``key`` holds exactly ``data``: True, False (absent or different),
        or None when the service could not be asked."""
        try:
            head = self.head(key)
            if head.size != len(data):
                return False
            return not data or self.get_range(key, 0, len(data), head.etag) == bytes(data)
        except AzureNotFound:
            return False
        except AzureError:
            return None

    def list_blobs(self, prefix: str, *, versions: bool = False) -> Iterator[Listed]:
        """Every committed blob under ``prefix``, paged; with ``versions``, every
        version of each (``is_current`` False for the older ones)."""
        try:
            for item in self.raw.list_blobs(
                name_starts_with=prefix, include=["versions"] if versions else None
            ):
                yield Listed(
                    key=str(item.name),
                    size=int(item.size or 0),
                    last_modified=item.last_modified,
                    version_id=getattr(item, "version_id", None),
                    is_current=getattr(item, "is_current_version", None) is not False,
                )
        except _sdk_errors() as exc:
            raise translate(exc, f"listing {self.url(prefix)}") from exc

    def list_uncommitted(self, prefix: str) -> list[Listed]:
        """Blobs under ``prefix`` that hold only staged blocks (a killed upload's).
        The service lists them beside committed blobs without marking them, so they
        are what a listing with ``uncommittedblobs`` holds beyond the committed one
        (a blob committed between the two listings counts as uncommitted here)."""
        committed = {item.key for item in self.list_blobs(prefix)}
        try:
            found = [
                Listed(str(item.name), 0, item.last_modified, uncommitted=True)
                for item in self.raw.list_blobs(
                    name_starts_with=prefix, include=["uncommittedblobs"]
                )
                if str(item.name) not in committed
            ]
        except _sdk_errors() as exc:
            raise translate(exc, f"listing uncommitted blobs under {self.url(prefix)}") from exc
        return found


def _date_of(headers: dict[str, str]) -> float:
    try:
        return email.utils.parsedate_to_datetime(headers["Date"]).timestamp()
    except (KeyError, TypeError, ValueError):
        return datetime.now(timezone.utc).timestamp()
