"""The one place ckptvault talks to boto3's KMS client: creation and error translation.

boto3 is imported lazily, here only, so that a local key store never loads it, and a
missing boto3 is a :class:`UsageError` that says how to install it. Every KMS call
goes through :meth:`KmsClient.call`, which turns boto3's exceptions into
:class:`KmsFailure` (KMS's error code, or None when KMS never answered). Callers
decide what a failure means where they know what they were doing; the two
translations shared by several of them live here: :meth:`KmsClient.service_error`
(the service, the network or the credentials failed: stop the caller) and
:meth:`KmsClient.unwrap_error` (this wrapped key or this KEK cannot be used: the
generation is refused and restore tries the next).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from ckptvault.aws import boto3_session
from ckptvault.errors import KeyServiceError, KeyUnavailableError, UsageError

MIN_PENDING_WINDOW_DAYS = 7  # AWS's bounds for ScheduleKeyDeletion
MAX_PENDING_WINDOW_DAYS = 30
# Answers about one key or one ciphertext: a generation naming it is refused
# (key-unavailable) and restore tries the next. Anything else — network, throttling,
# credentials, permissions — is about the service, and stops the caller.
ABOUT_THE_KEY = {
    "NotFoundException",
    "InvalidCiphertextException",
    "IncorrectKeyException",
    "InvalidKeyUsageException",
    "DisabledException",
    "KMSInvalidStateException",
    "KeyUnavailableException",
    "InvalidArnException",
    "ValidationException",
}
# Key states of a key on its way out (crypto-erase or a finished rotation).
STATE_GONE = {"PendingDeletion", "PendingReplicaDeletion"}


class KmsFailure(Exception):
    """A KMS request failed: ``code`` is KMS's error code, None without an answer."""

    def __init__(self, code: str | None, message: str) -> None:
        super().__init__(message)
        self.code = code


class KmsClient:
    """boto3's KMS client, made on first use, and the key store's ``location`` for
    error messages. ``client`` (tests, or a caller's own configuration) is used as
    given."""

    def __init__(
        self, region: str | None, endpoint_url: str | None, location: str, client: Any = None
    ) -> None:
        self.region = region
        self.endpoint_url = endpoint_url
        self.location = location
        self._client = client
        self._mutex = threading.Lock()

    def _kms(self) -> Any:
        with self._mutex:
            if self._client is None:
                try:
                    from botocore.config import Config

                    session = boto3_session()
                except ImportError as exc:
                    raise UsageError(
                        "kms:// key stores need boto3, which is not installed: "
                        "pip install ckptvault[s3]"
                    ) from exc
                config = Config(
                    retries={"mode": "standard", "max_attempts": 5},
                    connect_timeout=10,
                    read_timeout=30,
                )
                self._client = session.client(
                    "kms", region_name=self.region, endpoint_url=self.endpoint_url, config=config
                )
            return self._client

    def call(self, operation: str, **params: Any) -> dict[str, Any]:
        """KMS ``operation`` (boto3's method name); KmsFailure when it fails."""
        client = self._kms()
        import botocore.exceptions

        try:
            result: dict[str, Any] = getattr(client, operation)(**params)
        except botocore.exceptions.ParamValidationError as exc:  # e.g. an empty wrapped key
            raise KmsFailure("ValidationException", f"KMS {operation}: {exc}") from exc
        except botocore.exceptions.ClientError as exc:
            error = exc.response.get("Error") or {}
            code = str(error.get("Code") or "unknown")
            raise KmsFailure(code, f"KMS {operation}: {code} ({error.get('Message')})") from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise KmsFailure(None, f"KMS {operation}: {type(exc).__name__}: {exc}") from exc
        return result

    def service_error(self, failure: KmsFailure, doing: str) -> KeyServiceError:
        return KeyServiceError(
            f"{doing}: {failure} (key store {self.location}). Check the network, the AWS "
            "credentials and region, and that they may use this key (kms:Encrypt, "
            "kms:Decrypt, kms:DescribeKey, ...); then try again"
        )

    def unwrap_error(
        self, run_id: str, kek_id: str, failure: KmsFailure
    ) -> KeyUnavailableError | KeyServiceError:
        """What a failed Decrypt or ReEncrypt of a wrapped key of ``run_id`` means."""
        if failure.code in ABOUT_THE_KEY:
            return KeyUnavailableError(
                f"a wrapped key of run {run_id!r} does not open with KMS key {kek_id} "
                f"({failure.code}): it was edited, or belongs to another file, generation or run"
            )
        return self.service_error(failure, f"unwrapping a key of run {run_id!r}")

    def describe(self, key: str) -> dict[str, Any] | None:
        """DescribeKey's metadata, or None when there is no such key or alias."""
        try:
            return dict(self.call("describe_key", KeyId=key)["KeyMetadata"])
        except KmsFailure as failure:
            if failure.code == "NotFoundException":
                return None
            raise self.service_error(failure, f"looking up {key}") from failure

    def tags(self, key: str) -> dict[str, str]:
        """Every tag of ``key``; KeyServiceError when KMS cannot say."""
        try:
            return self.raw_tags(key)
        except KmsFailure as failure:
            raise self.service_error(failure, f"reading the tags of {key}") from failure

    def raw_tags(self, key: str) -> dict[str, str]:
        """Every tag of ``key``; KmsFailure for the caller to judge."""
        tags: dict[str, str] = {}
        params: dict[str, Any] = {"KeyId": key}
        while True:
            response = self.call("list_resource_tags", **params)
            tags.update({t["TagKey"]: t["TagValue"] for t in response.get("Tags", ())})
            if not response.get("Truncated"):
                return tags
            params["Marker"] = response["NextMarker"]

    def aliases(self) -> Iterator[dict[str, Any]]:
        """Every alias of the account and region, as ListAliases returns them."""
        import botocore.exceptions

        try:
            for page in self._kms().get_paginator("list_aliases").paginate():
                yield from page.get("Aliases", ())
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            raise self.service_error(KmsFailure(None, str(exc)), "listing KMS aliases") from exc


def date_text(value: object) -> str | None:
    """A KMS date (datetime from boto3, or epoch seconds) as text; None for none."""
    if value is None:
        return None
    isoformat = getattr(value, "isoformat", None)
    return str(isoformat()) if callable(isoformat) else str(value)
