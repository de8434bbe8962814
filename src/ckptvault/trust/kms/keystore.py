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

The parts: :mod:`~ckptvault.trust.kms.client` (the only module that touches boto3:
the client and the translation of its errors), :mod:`~ckptvault.trust.kms.names`
(aliases, tags, encryption context), :mod:`~ckptvault.trust.kms.run_keys` (finding,
creating and confirming a run's key), :mod:`~ckptvault.trust.kms.erase` (tombstones
and deletion) and :mod:`~ckptvault.trust.kms.rotation`. This module is the
:class:`KmsKeyStore` that composes them: its configuration, ``kms://`` URLs, and
``wrap``/``unwrap``.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, quote

from ckptvault.errors import KeyServiceError, KeyUnavailableError, UsageError
from ckptvault.trust.keystore import KeyInfo, RotationKeys
from ckptvault.trust.kms import erase as kms_erase
from ckptvault.trust.kms import rotation as kms_rotation
from ckptvault.trust.kms.client import (
    ABOUT_THE_KEY,
    MAX_PENDING_WINDOW_DAYS,
    MIN_PENDING_WINDOW_DAYS,
    KmsClient,
    KmsFailure,
)
from ckptvault.trust.kms.names import (
    ALIAS_PREFIX_RE,
    CONTEXT_BINDING,
    CONTEXT_PURPOSE,
    CONTEXT_RUN,
    DEFAULT_ALIAS_PREFIX,
    PURPOSE,
    TAG_CREATED,
    TAG_DESTROYED,
    TAG_RETIRED,
    TAG_ROLE,
    TAG_ROTATED_FROM,
    TAG_ROTATING_TO,
    TAG_RUN_HASH,
    TAG_RUN_ID,
    TOMBSTONES,
    run_hash,
    run_key_name,
    wrapping_context,
)
from ckptvault.trust.kms.run_keys import RunKeys

SCHEME = "kms://"


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
        if not ALIAS_PREFIX_RE.match(alias_prefix) or alias_prefix.startswith("alias/aws/"):
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
        self._keys = RunKeys(
            KmsClient(region, endpoint_url, self.location, client), key_id, alias_prefix
        )

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

    # -- the KeyStore protocol --------------------------------------------------------

    def wrap(self, run_id: str, data_key: bytes, context: bytes) -> tuple[str, bytes]:
        self.ensure_usable(run_id)
        keys = self._keys
        key = keys.shared_key_arn() if self.key_id is not None else keys.alias_of(run_id)
        params = {
            "Plaintext": bytes(data_key),
            "EncryptionContext": wrapping_context(run_id, context),
        }
        try:
            try:
                response = keys.client.call("encrypt", KeyId=key, **params)
            except KmsFailure as failure:
                if self.key_id is not None or failure.code != "NotFoundException":
                    raise
                # The run's first key: created here, named by its alias from now on.
                response = keys.client.call("encrypt", KeyId=keys.create_run_key(run_id), **params)
        except KmsFailure as failure:
            raise self._wrap_error(run_id, key, failure) from failure
        return str(response["KeyId"]), bytes(response["CiphertextBlob"])

    def _wrap_error(
        self, run_id: str, key: str, failure: KmsFailure
    ) -> KeyUnavailableError | KeyServiceError:
        if failure.code in ABOUT_THE_KEY:
            return KeyUnavailableError(f"KMS key {key} of run {run_id!r} cannot encrypt: {failure}")
        return self._keys.client.service_error(failure, f"wrapping a key of run {run_id!r}")

    def unwrap(self, run_id: str, kek_id: str, wrapped: bytes, context: bytes) -> bytes:
        self.ensure_usable(run_id)
        self._keys.check_key_of_run(run_id, kek_id)
        try:
            response = self._keys.client.call(
                "decrypt",
                CiphertextBlob=bytes(wrapped),
                KeyId=kek_id,
                EncryptionContext=wrapping_context(run_id, context),
            )
        except KmsFailure as failure:
            raise self._keys.client.unwrap_error(run_id, kek_id, failure) from failure
        return bytes(response["Plaintext"])

    def alias_of(self, run_id: str) -> str:
        return self._keys.alias_of(run_id)

    def list_keys(self) -> list[KeyInfo]:
        return self._keys.list_keys()

    # -- crypto-erase (kms_erase) -----------------------------------------------------

    def tombstone_alias_of(self, run_id: str) -> str:
        return self._keys.tombstone_alias_of(run_id)

    def is_destroyed(self, run_id: str) -> bool:
        return kms_erase.is_destroyed(self._keys, run_id)

    def ensure_usable(self, run_id: str) -> None:
        kms_erase.ensure_usable(self._keys, run_id)

    def destroy(self, run_id: str) -> KeyInfo:
        """Crypto-erase: tombstone first, then every key of the run disabled and
        scheduled for deletion; idempotent (:func:`~ckptvault.trust.kms.erase.destroy`)."""
        return kms_erase.destroy(self._keys, run_id, self.pending_window_days)

    # -- rotation (RotatingKeyStore, kms_rotation) ------------------------------------

    def begin_rotation(self, run_id: str) -> RotationKeys:
        return kms_rotation.begin_rotation(self._keys, run_id)

    def rewrap(self, run_id: str, kek_id: str, wrapped: bytes, context: bytes) -> tuple[str, bytes]:
        return kms_rotation.rewrap(self._keys, run_id, kek_id, wrapped, context)

    def finish_rotation(self, run_id: str) -> list[str]:
        return kms_rotation.finish_rotation(self._keys, run_id, self.pending_window_days)


# Names that moved to the modules above, importable from here as before.
__all__ = [
    "CONTEXT_BINDING",
    "CONTEXT_PURPOSE",
    "CONTEXT_RUN",
    "DEFAULT_ALIAS_PREFIX",
    "MAX_PENDING_WINDOW_DAYS",
    "MIN_PENDING_WINDOW_DAYS",
    "PURPOSE",
    "SCHEME",
    "TAG_CREATED",
    "TAG_DESTROYED",
    "TAG_RETIRED",
    "TAG_ROLE",
    "TAG_ROTATED_FROM",
    "TAG_ROTATING_TO",
    "TAG_RUN_HASH",
    "TAG_RUN_ID",
    "TOMBSTONES",
    "KmsKeyStore",
    "run_hash",
    "run_key_name",
    "wrapping_context",
]
