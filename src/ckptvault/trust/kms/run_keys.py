"""A run's KEK in KMS: found by its alias, created on first use, and confirmed as the
run's before a key named by a manifest is used.

The store is hostile ground (see :mod:`ckptvault.trust.kms.keystore`): a manifest's
``kek_id`` is only a claim, so :meth:`RunKeys.check_key_of_run` asks KMS whether the
key carries this run's ``ckptvault:run-hash`` tag (or, with one shared key, whether it
*is* that key) and is enabled, and remembers the answer until a destroy or rotation
changes it. Creating a run's key is a race between concurrent first users that the
alias settles: it is created once, and a loser retires its own unused key.
"""

from __future__ import annotations

import base64
import contextlib
import threading
from typing import Any

from ckptvault.errors import KeyUnavailableError, UsageError
from ckptvault.trust.keystore import KeyInfo
from ckptvault.trust.kms.client import (
    MIN_PENDING_WINDOW_DAYS,
    STATE_GONE,
    KmsClient,
    KmsFailure,
    date_text,
)
from ckptvault.trust.kms.names import (
    KEY_ARN_RE,
    TAG_CREATED,
    TAG_DESTROYED,
    TAG_RUN_HASH,
    TAG_RUN_ID,
    TOMBSTONES,
    run_hash,
    run_key_description,
    run_key_name,
    run_tags,
)


class RunKeys:
    """Where a key store's run keys are: a key per run under ``alias_prefix``
    (``key_id`` None), or the one key ``key_id`` for every run."""

    def __init__(self, client: KmsClient, key_id: str | None, alias_prefix: str) -> None:
        self.client = client
        self.key_id = key_id
        self.alias_prefix = alias_prefix
        self.location = client.location
        self._mutex = threading.Lock()
        self._verified: set[tuple[str, str]] = set()  # (run hash, key id) checked as the run's
        self._shared_arn: str | None = None

    # -- names ------------------------------------------------------------------------

    def alias_of(self, run_id: str) -> str:
        return self.alias_prefix + run_key_name(run_id)

    def tombstone_alias_of(self, run_id: str) -> str:
        return f"{self.alias_prefix}{TOMBSTONES}/{run_key_name(run_id)}"

    def require_per_run(self, what: str) -> None:
        if self.key_id is not None:
            raise UsageError(
                f"{what} needs a KMS key per run, but key store {self.location} uses one key "
                f"({self.key_id}) for every run: destroying or replacing it would affect every "
                "run at once. Rotate a shared key's material with KMS automatic rotation "
                "(aws kms enable-key-rotation: old ciphertexts keep decrypting, nothing is "
                "rewritten), or use per-run keys (kms:// or kms://alias/<prefix>/)"
            )

    # -- the run's key ----------------------------------------------------------------

    def shared_key_arn(self) -> str:
        assert self.key_id is not None
        with self._mutex:
            if self._shared_arn is not None:
                return self._shared_arn
        found = self.client.describe(self.key_id)
        if found is None:
            raise KeyUnavailableError(
                f"KMS has no key {self.key_id} (key store {self.location}); check the key id, "
                "region and account"
            )
        with self._mutex:
            self._shared_arn = str(found["Arn"])
        return self._shared_arn

    def current_key(self, run_id: str) -> str | None:
        """The ARN of the key the run's alias names now; None when it has none yet."""
        found = self.client.describe(self.alias_of(run_id))
        return str(found["Arn"]) if found is not None else None

    def create_run_key(self, run_id: str) -> str:
        """Create the run's key and its alias; the ARN of the key the alias names."""
        alias = self.alias_of(run_id)
        created: dict[str, Any] = {}
        try:
            created = self.client.call(
                "create_key",
                Description=run_key_description(run_id),
                KeyUsage="ENCRYPT_DECRYPT",
                Tags=run_tags(run_id),
            )["KeyMetadata"]
            self.client.call("create_alias", AliasName=alias, TargetKeyId=created["KeyId"])
        except KmsFailure as failure:
            if failure.code != "AlreadyExistsException" or not created:
                raise self.client.service_error(
                    failure, f"creating a KMS key for run {run_id!r}"
                ) from failure
            # Another process created the run's key first: use theirs, retire ours.
            retire_unused(self.client, str(created["KeyId"]))
            current = self.current_key(run_id)
            if current is None:
                raise KeyUnavailableError(
                    f"the KMS alias {alias} of run {run_id!r} vanished while it was created"
                ) from failure
            return current
        return str(created["Arn"])

    # -- is it the run's key? ---------------------------------------------------------

    def check_key_of_run(self, run_id: str, kek_id: str) -> None:
        """Refuse ``kek_id`` (from a manifest) unless KMS confirms it is the run's key
        and enabled (see :mod:`ckptvault.trust.kms.keystore`)."""
        if self.key_id is not None:
            self._check_shared_key(run_id, kek_id)
            return
        wanted = run_hash(run_id)
        with self._mutex:
            if (wanted, kek_id) in self._verified:
                return
        if not KEY_ARN_RE.match(kek_id):
            raise KeyUnavailableError(
                f"a generation of run {run_id!r} names {kek_id[:200]!r} as its KMS key, which is "
                "not a KMS key ARN (ckptvault records the ARN)"
            )
        metadata, tags = self._key_and_tags(run_id, kek_id)
        if tags.get(TAG_RUN_HASH) != wanted:
            raise KeyUnavailableError(
                f"KMS key {kek_id} is not a key of run {run_id!r} (its {TAG_RUN_HASH} tag does "
                "not match); refusing to use it: the manifest naming it was planted or moved"
            )
        state = metadata.get("KeyState")
        if state != "Enabled":
            why = (
                "destroyed or retired by a rotation, and scheduled for deletion"
                if state in STATE_GONE
                else "disabled by a KMS administrator"
            )
            raise KeyUnavailableError(f"KMS key {kek_id} of run {run_id!r} is {state}: {why}")
        with self._mutex:
            self._verified.add((wanted, kek_id))

    def _check_shared_key(self, run_id: str, kek_id: str) -> None:
        if kek_id != self.shared_key_arn():
            raise KeyUnavailableError(
                f"a generation of run {run_id!r} names KMS key {kek_id}, not the key "
                f"{self.key_id} of key store {self.location}; refusing to use it"
            )

    def _key_and_tags(self, run_id: str, kek_id: str) -> tuple[dict[str, Any], dict[str, str]]:
        """DescribeKey's metadata and the tags of a key a generation names: an answer
        about the key refuses the generation, no answer stops the caller."""
        try:
            metadata = self.client.call("describe_key", KeyId=kek_id)["KeyMetadata"]
            tags = self.client.raw_tags(kek_id)
        except KmsFailure as failure:
            if failure.code is None:
                raise self.client.service_error(failure, f"looking up key {kek_id}") from failure
            raise KeyUnavailableError(
                f"KMS key {kek_id}, named by a generation of run {run_id!r}, cannot be used "
                f"({failure.code}): it was deleted after crypto-erase or rotation, or it is "
                "not a key of this account and region"
            ) from failure
        return metadata, tags

    def forget_verified(self) -> None:
        """Forget every confirmation: a destroy or rotation changed which keys count."""
        with self._mutex:
            self._verified.clear()

    # -- listing ----------------------------------------------------------------------

    def list_keys(self) -> list[KeyInfo]:
        """The shared key, or every run with a key or a tombstone under the prefix."""
        if self.key_id is not None:
            arn = self.shared_key_arn()
            created = date_text((self.client.describe(arn) or {}).get("CreationDate"))
            return [KeyInfo("(every run)", arn, created or "unknown")]
        runs: dict[str, KeyInfo] = {}
        tombstones = f"{self.alias_prefix}{TOMBSTONES}/"
        for alias in self.client.aliases():
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
        metadata = self.client.describe(key) or {}
        tags = self.client.tags(key) if metadata else {}
        run_id = short
        if TAG_RUN_ID in tags:
            with contextlib.suppress(ValueError):
                run_id = base64.b64decode(tags[TAG_RUN_ID], validate=True).decode("utf-8")
        return KeyInfo(
            run_id,
            str(metadata.get("Arn", key)),
            tags.get(TAG_CREATED, "unknown"),
            tags.get(TAG_DESTROYED),
            date_text(metadata.get("DeletionDate")),
        )


def retire_unused(client: KmsClient, key: str) -> None:
    """Schedule an unused key's deletion (``key``: its bare id) after AWS's shortest
    window; a failure leaves an unused key behind."""
    try:
        client.call("disable_key", KeyId=key)
        client.call("schedule_key_deletion", KeyId=key, PendingWindowInDays=MIN_PENDING_WINDOW_DAYS)
    except KmsFailure:
        pass
