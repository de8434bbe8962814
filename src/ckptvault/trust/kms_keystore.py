"""An AWS KMS key store: the run's KEK never leaves KMS.

:class:`KmsKeyStore` implements :class:`~ckptvault.trust.keystore.KeyStore` (and
:class:`~ckptvault.trust.keystore.RotatingKeyStore`) on boto3, imported only when a
``kms://`` key store is opened. ``wrap`` is KMS ``Encrypt``, ``unwrap`` is
``Decrypt``, ``rewrap`` is ``ReEncrypt``: data keys go to KMS and come back, the KEK
never comes out. Every call carries an *encryption context* that KMS binds into the
ciphertext and checks on the way back::

    ckptvault:run      the run id (usable in IAM conditions, visible in CloudTrail)
    ckptvault:binding  base64 of the wrapping context: run id, generation id and file
                       name, or the manifest MAC key's purpose label
    ckptvault:purpose  "key-wrap v1"

so a wrapped key moved to another file, generation or run does not decrypt.

How a run finds its key:

- **A key per run** (the default, ``key_id=None``): created on first use, tagged
  ``ckptvault:run-hash`` (BLAKE3 of the run id), ``ckptvault:run-id`` (base64 of the
  run id, when it fits a tag) and ``ckptvault:created-at``, and named by the alias
  ``<alias_prefix><readable run id>-<20 hex digits of its hash>``. Concurrent first
  users agree on one key: the alias is created once; a loser schedules its own
  unused key for deletion and uses the winner's.
- **One customer managed key for every run** (``key_id=`` a key id, ARN or alias):
  nothing is created. Crypto-erase of one run and ``keys rotate`` need per-run keys
  and are refused; rotate a shared key's material with KMS automatic rotation.

A manifest names the KEK that wrapped its keys (``kek_id``, the key's ARN), and the
store is hostile ground: whoever can write it could name a key of their own that the
trainer's credentials may use. So a key is used for a run only after KMS confirms it
is this run's: its ``ckptvault:run-hash`` tag (which only a KMS administrator of the
account can set; another account's key cannot even be asked) — or, with one shared
key, that it *is* that key — and it is ``Enabled``.

Crypto-erase (:meth:`KmsKeyStore.destroy`) records a tombstone first — an alias
``<alias_prefix>tombstones/<name>`` on a disabled marker key (alias
``<alias_prefix>tombstones``, created once, never used to encrypt) that outlives the
run's key — then tags the run's key(s) ``ckptvault:destroyed-at``, disables them and
schedules their deletion (``pending_window_days``, 7 to 30, AWS's bounds). From the
tombstone on, every wrap and unwrap of the run raises KeyDestroyedError. AWS
deletes the key material when the window ends; until then a KMS administrator could
cancel the deletion and re-enable the key.

Rotation makes a new key for the run (tagged ``ckptvault:rotated-from`` the old
one's ARN), tags the old one ``ckptvault:rotating-to`` and moves the alias; wrapped
keys move with ``ReEncrypt``; finishing disables the old key and schedules its
deletion like crypto-erase does.
"""

from __future__ import annotations

import base64
import contextlib
import json
import re
import threading
from collections.abc import Iterator
from typing import Any
from urllib.parse import parse_qs, quote

from blake3 import blake3

from ckptvault.errors import (
    KeyDestroyedError,
    KeyServiceError,
    KeyUnavailableError,
    UsageError,
)
from ckptvault.format.layout import utc_now as _now
from ckptvault.trust.keystore import KeyInfo, RotationKeys

SCHEME = "kms://"
DEFAULT_ALIAS_PREFIX = "alias/ckptvault/"
MIN_PENDING_WINDOW_DAYS = 7  # AWS's bounds for ScheduleKeyDeletion
MAX_PENDING_WINDOW_DAYS = 30
TOMBSTONES = "tombstones"

TAG_RUN_HASH = "ckptvault:run-hash"
TAG_RUN_ID = "ckptvault:run-id"
TAG_CREATED = "ckptvault:created-at"
TAG_DESTROYED = "ckptvault:destroyed-at"
TAG_ROTATED_FROM = "ckptvault:rotated-from"
TAG_ROTATING_TO = "ckptvault:rotating-to"
TAG_RETIRED = "ckptvault:retired-at"
TAG_ROLE = "ckptvault:role"

CONTEXT_RUN = "ckptvault:run"
CONTEXT_BINDING = "ckptvault:binding"
CONTEXT_PURPOSE = "ckptvault:purpose"
PURPOSE = "key-wrap v1"

_ALIAS_PREFIX_RE = re.compile(r"^alias/[A-Za-z0-9/_-]{0,200}/$")
# What ckptvault records as a KEK id: the key's ARN, as Encrypt returns it.
_KEY_ARN_RE = re.compile(r"^arn:aws[a-z-]*:kms:[a-z0-9-]{1,32}:[0-9]{12}:key/[A-Za-z0-9-]{1,128}$")
_UNREADABLE_ALIAS_CHARS = re.compile(r"[^A-Za-z0-9_-]")
_MAX_TAG_VALUE = 256
# Answers about one key or one ciphertext: a generation naming it is refused
# (key-unavailable) and restore tries the next. Anything else — network, throttling,
# credentials, permissions — is about the service, and stops the caller.
_ABOUT_THE_KEY = {
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
_STATE_GONE = {"PendingDeletion", "PendingReplicaDeletion"}


class _KmsFailure(Exception):
    """A KMS request failed: ``code`` is KMS's error code, None without an answer."""

    def __init__(self, code: str | None, message: str) -> None:
        super().__init__(message)
        self.code = code


def run_hash(run_id: str) -> str:
    return blake3(run_id.encode("utf-8")).hexdigest()


def run_key_name(run_id: str) -> str:
    """``<readable run id>-<hash>``: alias characters only, unique per run id."""
    readable = _UNREADABLE_ALIAS_CHARS.sub("_", run_id)[:64]
    return f"{readable}-{run_hash(run_id)[:20]}"


def wrapping_context(run_id: str, context: bytes) -> dict[str, str]:
    """The KMS encryption context of one wrapped key."""
    return {
        CONTEXT_RUN: run_id,
        CONTEXT_BINDING: base64.b64encode(context).decode("ascii"),
        CONTEXT_PURPOSE: PURPOSE,
    }


class KmsKeyStore:
    """KEKs as AWS KMS keys (see the module docstring)."""

    def __init__(
        self,
        region: str | None = None,
        endpoint_url: str | None = None,
        key_id: str | None = None,
        alias_prefix: str = DEFAULT_ALIAS_PREFIX,
        pending_window_days: int = MAX_PENDING_WINDOW_DAYS,
        client: Any = None,
    ) -> None:
        if not _ALIAS_PREFIX_RE.match(alias_prefix) or alias_prefix.startswith("alias/aws/"):
            raise UsageError(
                f"KMS alias prefix {alias_prefix!r} must look like 'alias/ckptvault/': start "
                "with 'alias/' (not 'alias/aws/'), end with '/', and hold only letters, "
                "digits, '/', '_' and '-'"
            )
        if (
            isinstance(pending_window_days, bool)
            or not isinstance(pending_window_days, int)
            or not MIN_PENDING_WINDOW_DAYS <= pending_window_days <= MAX_PENDING_WINDOW_DAYS
        ):
            raise UsageError(
                f"pending_window_days={pending_window_days!r}: AWS KMS deletes a key after a "
                f"waiting period of {MIN_PENDING_WINDOW_DAYS} to {MAX_PENDING_WINDOW_DAYS} days"
            )
        if key_id is not None and not key_id:
            raise UsageError("key_id is empty; give a KMS key id, ARN or alias, or None")
        self.region = region
        self.endpoint_url = endpoint_url
        self.key_id = key_id
        self.alias_prefix = alias_prefix
        self.pending_window_days = pending_window_days
        self.location = self._url()
        self._client = client
        self._mutex = threading.Lock()
        self._verified: set[tuple[str, str]] = set()  # (run hash, key id) checked as the run's
        self._shared_arn: str | None = None

    @classmethod
    def from_url(cls, url: str) -> KmsKeyStore:
        """``kms://`` (a key per run, default alias prefix), ``kms://alias/prefix/``
        (a key per run under that prefix: it ends with ``/``), or
        ``kms://<key id | key ARN | alias/name>`` (one key for every run); options as
        a query: ``?region=R&endpoint_url=URL&pending_window_days=N``."""
        if not url.startswith(SCHEME):
            raise UsageError(f"{url!r} is not a kms:// URL")
        spec, _, query = url[len(SCHEME) :].partition("?")
        options = {name: values[-1] for name, values in parse_qs(query).items()}
        unknown = sorted(set(options) - {"region", "endpoint_url", "pending_window_days"})
        if unknown:
            raise UsageError(
                f"{url}: unknown option(s) {', '.join(unknown)}; kms:// URLs take region, "
                "endpoint_url and pending_window_days"
            )
        window = options.get("pending_window_days", str(MAX_PENDING_WINDOW_DAYS))
        if not window.isdigit():
            raise UsageError(f"{url}: pending_window_days must be a number of days (7 to 30)")
        per_run = spec == "" or spec.endswith("/")
        return cls(
            region=options.get("region"),
            endpoint_url=options.get("endpoint_url"),
            key_id=None if per_run else spec,
            alias_prefix=spec if per_run and spec else DEFAULT_ALIAS_PREFIX,
            pending_window_days=int(window),
        )

    def _url(self) -> str:
        query = []
        if self.region:
            query.append(f"region={quote(self.region, safe='')}")
        if self.endpoint_url:
            query.append(f"endpoint_url={quote(self.endpoint_url, safe='')}")
        if self.pending_window_days != MAX_PENDING_WINDOW_DAYS:
            query.append(f"pending_window_days={self.pending_window_days}")
        spec = self.key_id if self.key_id is not None else self.alias_prefix
        return SCHEME + spec + ("?" + "&".join(query) if query else "")

    def __repr__(self) -> str:
        return f"KmsKeyStore({self.location!r})"

    # -- talking to KMS ---------------------------------------------------------------

    def _kms(self) -> Any:
        with self._mutex:
            if self._client is None:
                try:
                    import boto3
                    from botocore.config import Config
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
                self._client = boto3.session.Session().client(
                    "kms", region_name=self.region, endpoint_url=self.endpoint_url, config=config
                )
            return self._client

    def _call(self, operation: str, **params: Any) -> dict[str, Any]:
        client = self._kms()
        import botocore.exceptions

        try:
            result: dict[str, Any] = getattr(client, operation)(**params)
        except botocore.exceptions.ParamValidationError as exc:  # e.g. an empty wrapped key
            raise _KmsFailure("ValidationException", f"KMS {operation}: {exc}") from exc
        except botocore.exceptions.ClientError as exc:
            error = exc.response.get("Error") or {}
            code = str(error.get("Code") or "unknown")
            raise _KmsFailure(code, f"KMS {operation}: {code} ({error.get('Message')})") from exc
        except botocore.exceptions.BotoCoreError as exc:
            raise _KmsFailure(None, f"KMS {operation}: {type(exc).__name__}: {exc}") from exc
        return result

    def _service_error(self, failure: _KmsFailure, doing: str) -> KeyServiceError:
        return KeyServiceError(
            f"{doing}: {failure} (key store {self.location}). Check the network, the AWS "
            "credentials and region, and that they may use this key (kms:Encrypt, "
            "kms:Decrypt, kms:DescribeKey, ...); then try again"
        )

    def _describe(self, key: str) -> dict[str, Any] | None:
        """DescribeKey's metadata, or None when there is no such key or alias."""
        try:
            return dict(self._call("describe_key", KeyId=key)["KeyMetadata"])
        except _KmsFailure as failure:
            if failure.code == "NotFoundException":
                return None
            raise self._service_error(failure, f"looking up {key}") from failure

    def _tags(self, key: str) -> dict[str, str]:
        try:
            return self._raw_tags(key)
        except _KmsFailure as failure:
            raise self._service_error(failure, f"reading the tags of {key}") from failure

    def _raw_tags(self, key: str) -> dict[str, str]:
        tags: dict[str, str] = {}
        params: dict[str, Any] = {"KeyId": key}
        while True:
            response = self._call("list_resource_tags", **params)
            tags.update({t["TagKey"]: t["TagValue"] for t in response.get("Tags", ())})
            if not response.get("Truncated"):
                return tags
            params["Marker"] = response["NextMarker"]

    def _aliases(self) -> Iterator[dict[str, Any]]:
        import botocore.exceptions

        try:
            for page in self._kms().get_paginator("list_aliases").paginate():
                yield from page.get("Aliases", ())
        except (botocore.exceptions.ClientError, botocore.exceptions.BotoCoreError) as exc:
            raise self._service_error(_KmsFailure(None, str(exc)), "listing KMS aliases") from exc

    # -- names ------------------------------------------------------------------------

    def alias_of(self, run_id: str) -> str:
        return self.alias_prefix + run_key_name(run_id)

    def tombstone_alias_of(self, run_id: str) -> str:
        return f"{self.alias_prefix}{TOMBSTONES}/{run_key_name(run_id)}"

    def _run_tags(self, run_id: str, **extra: str) -> list[dict[str, str]]:
        tags = {TAG_RUN_HASH: run_hash(run_id), TAG_CREATED: _now(), **extra}
        encoded = base64.b64encode(run_id.encode("utf-8")).decode("ascii")
        if len(encoded) <= _MAX_TAG_VALUE:
            tags[TAG_RUN_ID] = encoded
        return [{"TagKey": key, "TagValue": value} for key, value in tags.items()]

    def _require_per_run(self, what: str) -> None:
        if self.key_id is not None:
            raise UsageError(
                f"{what} needs a KMS key per run, but key store {self.location} uses one key "
                f"({self.key_id}) for every run: destroying or replacing it would affect every "
                "run at once. Rotate a shared key's material with KMS automatic rotation "
                "(aws kms enable-key-rotation: old ciphertexts keep decrypting, nothing is "
                "rewritten), or use per-run keys (kms:// or kms://alias/<prefix>/)"
            )

    # -- tombstones -------------------------------------------------------------------

    def is_destroyed(self, run_id: str) -> bool:
        if self.key_id is not None:
            return False  # a shared key is never destroyed for one run
        return self._describe(self.tombstone_alias_of(run_id)) is not None

    def ensure_usable(self, run_id: str) -> None:
        if self.is_destroyed(run_id):
            raise self._destroyed_error(run_id)

    def _destroyed_error(self, run_id: str) -> KeyDestroyedError:
        return KeyDestroyedError(
            f"the KMS key of run {run_id!r} was destroyed (tombstone "
            f"{self.tombstone_alias_of(run_id)} in {self.location}); every generation of this "
            "run is unreadable and no new generation can be saved under this run id. Start a "
            "new run id."
        )

    def _tombstone_holder(self) -> str:
        """The marker key the tombstone aliases point at (created disabled, once)."""
        alias = self.alias_prefix + TOMBSTONES
        found = self._describe(alias)
        if found is not None:
            return str(found["Arn"])
        created: dict[str, Any] = {}
        try:
            created = self._call(
                "create_key",
                Description=(
                    "ckptvault tombstones: never encrypts anything. Its aliases "
                    f"({alias}/...) record which runs' keys were destroyed; deleting it "
                    "would let new saves reuse a destroyed run id"
                ),
                Tags=[{"TagKey": TAG_ROLE, "TagValue": TOMBSTONES}],
            )["KeyMetadata"]
            self._call("disable_key", KeyId=created["KeyId"])
            self._call("create_alias", AliasName=alias, TargetKeyId=created["KeyId"])
        except _KmsFailure as failure:
            if failure.code == "AlreadyExistsException" and created:  # a concurrent destroy
                self._retire_quietly(str(created["KeyId"]))
                return self._tombstone_holder()
            raise self._service_error(failure, "creating the tombstone marker key") from failure
        return str(created["Arn"])

    # -- the run's key ----------------------------------------------------------------

    def _shared_key_arn(self) -> str:
        assert self.key_id is not None
        with self._mutex:
            if self._shared_arn is not None:
                return self._shared_arn
        found = self._describe(self.key_id)
        if found is None:
            raise KeyUnavailableError(
                f"KMS has no key {self.key_id} (key store {self.location}); check the key id, "
                "region and account"
            )
        with self._mutex:
            self._shared_arn = str(found["Arn"])
        return self._shared_arn

    def _current_key(self, run_id: str) -> str | None:
        """The ARN of the key the run's alias names now; None when it has none yet."""
        found = self._describe(self.alias_of(run_id))
        return str(found["Arn"]) if found is not None else None

    def _create_run_key(self, run_id: str) -> str:
        alias = self.alias_of(run_id)
        created: dict[str, Any] = {}
        try:
            created = self._call(
                "create_key",
                Description=f"ckptvault key-encryption key of run {json.dumps(run_id)[:7000]}",
                KeyUsage="ENCRYPT_DECRYPT",
                Tags=self._run_tags(run_id),
            )["KeyMetadata"]
            self._call("create_alias", AliasName=alias, TargetKeyId=created["KeyId"])
        except _KmsFailure as failure:
            if failure.code != "AlreadyExistsException" or not created:
                raise self._service_error(failure, f"creating a KMS key for run {run_id!r}") from (
                    failure
                )
            # Another process created the run's key first: use theirs, retire ours.
            self._retire_quietly(str(created["KeyId"]))
            current = self._current_key(run_id)
            if current is None:
                raise KeyUnavailableError(
                    f"the KMS alias {alias} of run {run_id!r} vanished while it was created"
                ) from failure
            return current
        return str(created["Arn"])

    def _retire_quietly(self, key: str) -> None:
        """Schedule an unused key's deletion (``key``: its bare id); a failure leaves
        an unused key behind."""
        try:
            self._call("disable_key", KeyId=key)
            self._call(
                "schedule_key_deletion", KeyId=key, PendingWindowInDays=MIN_PENDING_WINDOW_DAYS
            )
        except _KmsFailure:
            pass

    def _check_key_of_run(self, run_id: str, kek_id: str) -> None:
        """Refuse ``kek_id`` (from a manifest) unless KMS confirms it is the run's key
        and enabled (see the module docstring)."""
        if self.key_id is not None:
            if kek_id != self._shared_key_arn():
                raise KeyUnavailableError(
                    f"a generation of run {run_id!r} names KMS key {kek_id}, not the key "
                    f"{self.key_id} of key store {self.location}; refusing to use it"
                )
            return
        wanted = run_hash(run_id)
        with self._mutex:
            if (wanted, kek_id) in self._verified:
                return
        if not _KEY_ARN_RE.match(kek_id):
            raise KeyUnavailableError(
                f"a generation of run {run_id!r} names {kek_id[:200]!r} as its KMS key, which is "
                "not a KMS key ARN (ckptvault records the ARN)"
            )
        try:
            metadata = self._call("describe_key", KeyId=kek_id)["KeyMetadata"]
            tags = self._raw_tags(kek_id)
        except _KmsFailure as failure:
            if failure.code is None:
                raise self._service_error(failure, f"looking up key {kek_id}") from failure
            raise KeyUnavailableError(
                f"KMS key {kek_id}, named by a generation of run {run_id!r}, cannot be used "
                f"({failure.code}): it was deleted after crypto-erase or rotation, or it is "
                "not a key of this account and region"
            ) from failure
        if tags.get(TAG_RUN_HASH) != wanted:
            raise KeyUnavailableError(
                f"KMS key {kek_id} is not a key of run {run_id!r} (its {TAG_RUN_HASH} tag does "
                "not match); refusing to use it: the manifest naming it was planted or moved"
            )
        state = metadata.get("KeyState")
        if state != "Enabled":
            why = (
                "destroyed or retired by a rotation, and scheduled for deletion"
                if state in _STATE_GONE
                else "disabled by a KMS administrator"
            )
            raise KeyUnavailableError(f"KMS key {kek_id} of run {run_id!r} is {state}: {why}")
        with self._mutex:
            self._verified.add((wanted, kek_id))

    def _forget_verified(self) -> None:
        with self._mutex:
            self._verified.clear()

    # -- the KeyStore protocol --------------------------------------------------------

    def wrap(self, run_id: str, data_key: bytes, context: bytes) -> tuple[str, bytes]:
        self.ensure_usable(run_id)
        key = self._shared_key_arn() if self.key_id is not None else self.alias_of(run_id)
        params = {
            "Plaintext": bytes(data_key),
            "EncryptionContext": wrapping_context(run_id, context),
        }
        try:
            try:
                response = self._call("encrypt", KeyId=key, **params)
            except _KmsFailure as failure:
                if self.key_id is not None or failure.code != "NotFoundException":
                    raise
                # The run's first key: created here, named by its alias from now on.
                response = self._call("encrypt", KeyId=self._create_run_key(run_id), **params)
        except _KmsFailure as failure:
            if failure.code in _ABOUT_THE_KEY:
                raise KeyUnavailableError(
                    f"KMS key {key} of run {run_id!r} cannot encrypt: {failure}"
                ) from failure
            raise self._service_error(failure, f"wrapping a key of run {run_id!r}") from failure
        return str(response["KeyId"]), bytes(response["CiphertextBlob"])

    def unwrap(self, run_id: str, kek_id: str, wrapped: bytes, context: bytes) -> bytes:
        self.ensure_usable(run_id)
        self._check_key_of_run(run_id, kek_id)
        try:
            response = self._call(
                "decrypt",
                CiphertextBlob=bytes(wrapped),
                KeyId=kek_id,
                EncryptionContext=wrapping_context(run_id, context),
            )
        except _KmsFailure as failure:
            raise self._unwrap_error(run_id, kek_id, failure) from failure
        return bytes(response["Plaintext"])

    def _unwrap_error(
        self, run_id: str, kek_id: str, failure: _KmsFailure
    ) -> KeyUnavailableError | KeyServiceError:
        if failure.code in _ABOUT_THE_KEY:
            return KeyUnavailableError(
                f"a wrapped key of run {run_id!r} does not open with KMS key {kek_id} "
                f"({failure.code}): it was edited, or belongs to another file, generation or run"
            )
        return self._service_error(failure, f"unwrapping a key of run {run_id!r}")

    def destroy(self, run_id: str) -> KeyInfo:
        """Tombstone first, then disable every key of the run (the current one and a
        retired one of an unfinished rotation) and schedule its deletion. Idempotent:
        a second call finishes what an interrupted one started."""
        self._require_per_run("crypto-erase of one run")
        current = self._current_key(run_id)
        tombstoned = self.is_destroyed(run_id)
        if current is None and not tombstoned:
            raise UsageError(f"key store {self.location} holds no key for run {run_id!r}")
        if not tombstoned:
            holder = self._tombstone_holder()
            try:
                self._call(
                    "create_alias", AliasName=self.tombstone_alias_of(run_id), TargetKeyId=holder
                )
            except _KmsFailure as failure:
                if failure.code != "AlreadyExistsException":
                    raise self._service_error(
                        failure, f"recording the tombstone of {run_id!r}"
                    ) from (failure)
        self._forget_verified()
        if current is None:  # deleted by KMS after an earlier destroy's window
            return KeyInfo(run_id, "deleted", "unknown", "unknown (the key is already deleted)")
        tags = self._tags(current)
        destroyed_at = tags.get(TAG_DESTROYED) or _now()
        # Also a retired key of an unfinished rotation, and a new key an interrupted
        # rotation made but never used.
        keys = [current] + [tags[t] for t in (TAG_ROTATED_FROM, TAG_ROTATING_TO) if tags.get(t)]
        deleted_after = None
        for key in keys:
            deleted_after = self._schedule_deletion(key, {TAG_DESTROYED: destroyed_at}) or (
                deleted_after
            )
        return KeyInfo(
            run_id, current, tags.get(TAG_CREATED, "unknown"), destroyed_at, deleted_after
        )

    def _schedule_deletion(self, key: str, tags: dict[str, str]) -> str | None:
        """Tag, disable and schedule the deletion of ``key``; returns the deletion
        date when KMS gives one. Already pending or already deleted is fine."""
        found = self._describe(key)
        if found is None:
            return None
        try:
            self._call(
                "tag_resource",
                KeyId=key,
                Tags=[{"TagKey": name, "TagValue": value} for name, value in tags.items()],
            )
            if found.get("KeyState") not in _STATE_GONE:
                key_id = found["KeyId"]  # (some KMS emulators take only the bare id here)
                self._call("disable_key", KeyId=key_id)
                response = self._call(
                    "schedule_key_deletion",
                    KeyId=key_id,
                    PendingWindowInDays=self.pending_window_days,
                )
                when = response.get("DeletionDate")
            else:
                when = found.get("DeletionDate")
        except _KmsFailure as failure:
            raise self._service_error(failure, f"scheduling the deletion of {key}") from failure
        return _date_text(when)

    def list_keys(self) -> list[KeyInfo]:
        if self.key_id is not None:
            arn = self._shared_key_arn()
            created = _date_text((self._describe(arn) or {}).get("CreationDate")) or "unknown"
            return [KeyInfo("(every run)", arn, created)]
        runs: dict[str, KeyInfo] = {}
        tombstones = f"{self.alias_prefix}{TOMBSTONES}/"
        for alias in self._aliases():
            name = str(alias.get("AliasName", ""))
            if not name.startswith(self.alias_prefix) or name == self.alias_prefix + TOMBSTONES:
                continue
            if name.startswith(tombstones):
                short = name[len(tombstones) :]
                runs.setdefault(
                    short, KeyInfo(short, "deleted", "unknown", "unknown (the key is deleted)")
                )
                continue
            short = name[len(self.alias_prefix) :]
            if "/" in short or not alias.get("TargetKeyId"):
                continue
            info = self._run_key_info(short, str(alias["TargetKeyId"]))
            if info.destroyed_at is not None or short not in runs:
                runs[short] = info
        return sorted(runs.values(), key=lambda info: info.run_id)

    def _run_key_info(self, short: str, key: str) -> KeyInfo:
        metadata = self._describe(key) or {}
        tags = self._tags(key) if metadata else {}
        run_id = short
        if TAG_RUN_ID in tags:
            with contextlib.suppress(ValueError):
                run_id = base64.b64decode(tags[TAG_RUN_ID], validate=True).decode("utf-8")
        return KeyInfo(
            run_id,
            str(metadata.get("Arn", key)),
            tags.get(TAG_CREATED, "unknown"),
            tags.get(TAG_DESTROYED),
            _date_text(metadata.get("DeletionDate")),
        )

    # -- rotation (RotatingKeyStore) --------------------------------------------------

    def begin_rotation(self, run_id: str) -> RotationKeys:
        self._require_per_run("rotating one run's key")
        self.ensure_usable(run_id)
        current = self._current_key(run_id)
        if current is None:
            raise UsageError(
                f"key store {self.location} holds no key for run {run_id!r}; nothing to rotate"
            )
        try:
            tags = self._tags(current)
            previous = tags.get(TAG_ROTATED_FROM)
            if previous:
                found = self._describe(previous)
                if found is not None and found.get("KeyState") not in _STATE_GONE:
                    return RotationKeys(run_id, current, (previous,), resumed=True)
                # Finished, but the marker stayed (interrupted after the deletion).
                self._call("untag_resource", KeyId=current, TagKeys=[TAG_ROTATED_FROM])
            successor = tags.get(TAG_ROTATING_TO)
            new_key = self._usable_successor(run_id, successor) if successor else None
            if new_key is None:
                new_key = str(
                    self._call(
                        "create_key",
                        Description=(
                            f"ckptvault key-encryption key of run {json.dumps(run_id)[:7000]}"
                        ),
                        KeyUsage="ENCRYPT_DECRYPT",
                        Tags=self._run_tags(run_id, **{TAG_ROTATED_FROM: current}),
                    )["KeyMetadata"]["Arn"]
                )
                self._call(
                    "tag_resource",
                    KeyId=current,
                    Tags=[{"TagKey": TAG_ROTATING_TO, "TagValue": new_key}],
                )
            self._call("update_alias", AliasName=self.alias_of(run_id), TargetKeyId=new_key)
        except _KmsFailure as failure:
            raise self._service_error(failure, f"rotating the key of run {run_id!r}") from failure
        self._forget_verified()
        return RotationKeys(run_id, new_key, (current,), resumed=False)

    def _usable_successor(self, run_id: str, key: str) -> str | None:
        """The new key an interrupted begin_rotation made, if it is still usable."""
        found = self._describe(key)
        if found is None or found.get("KeyState") != "Enabled":
            return None
        if self._tags(key).get(TAG_RUN_HASH) != run_hash(run_id):
            return None
        return str(found["Arn"])

    def rewrap(self, run_id: str, kek_id: str, wrapped: bytes, context: bytes) -> tuple[str, bytes]:
        self.ensure_usable(run_id)
        self._check_key_of_run(run_id, kek_id)
        target = self._current_key(run_id)
        if target is None:
            raise KeyUnavailableError(f"run {run_id!r} has no current KMS key to rewrap under")
        encryption_context = wrapping_context(run_id, context)
        try:
            response = self._call(
                "re_encrypt",
                CiphertextBlob=bytes(wrapped),
                SourceEncryptionContext=encryption_context,
                SourceKeyId=kek_id,
                DestinationKeyId=target,
                DestinationEncryptionContext=encryption_context,
            )
        except _KmsFailure as failure:
            raise self._unwrap_error(run_id, kek_id, failure) from failure
        return str(response["KeyId"]), bytes(response["CiphertextBlob"])

    def finish_rotation(self, run_id: str) -> list[str]:
        self._require_per_run("rotating one run's key")
        current = self._current_key(run_id)
        if current is None:
            return []
        previous = self._tags(current).get(TAG_ROTATED_FROM)
        if not previous:
            return []
        self._schedule_deletion(previous, {TAG_RETIRED: _now()})
        try:
            self._call("untag_resource", KeyId=current, TagKeys=[TAG_ROTATED_FROM])
        except _KmsFailure as failure:
            raise self._service_error(failure, f"finishing the rotation of {run_id!r}") from failure
        self._forget_verified()
        return [previous]


def _date_text(value: object) -> str | None:
    """A KMS date (datetime from boto3, or epoch seconds) as text; None for none."""
    if value is None:
        return None
    isoformat = getattr(value, "isoformat", None)
    return str(isoformat()) if callable(isoformat) else str(value)
