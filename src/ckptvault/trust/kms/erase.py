"""Crypto-erase in KMS: the tombstone that says a run's key is gone, and the deletion.

The tombstone comes first and outlives the key: an alias
``<alias_prefix>tombstones/<name>`` on a disabled marker key (alias
``<alias_prefix>tombstones``, created once, never used to encrypt). From the moment
it exists every wrap and unwrap of the run raises KeyDestroyedError, so an
interrupted erase never leaves a run id that a new save could take up again under a
fresh key, and the id stays spent after AWS deletes the key itself (its alias goes
with it). Only then are the run's keys tagged
``ckptvault:destroyed-at``, disabled and scheduled for deletion. Each step is
idempotent, so a second :func:`destroy` finishes what an interrupted one started.
:func:`schedule_deletion` also retires the old key of a finished rotation.
"""

from __future__ import annotations

from typing import Any

from ckptvault.errors import KeyDestroyedError, UsageError
from ckptvault.format.layout import utc_now as _now
from ckptvault.trust.keystore import KeyInfo
from ckptvault.trust.kms.client import STATE_GONE, KmsFailure, date_text
from ckptvault.trust.kms.names import (
    TAG_CREATED,
    TAG_DESTROYED,
    TAG_ROLE,
    TAG_ROTATED_FROM,
    TAG_ROTATING_TO,
    TOMBSTONES,
)
from ckptvault.trust.kms.run_keys import RunKeys, retire_unused


def is_destroyed(keys: RunKeys, run_id: str) -> bool:
    if keys.key_id is not None:
        return False  # a shared key is never destroyed for one run
    return keys.client.describe(keys.tombstone_alias_of(run_id)) is not None


def ensure_usable(keys: RunKeys, run_id: str) -> None:
    if is_destroyed(keys, run_id):
        raise KeyDestroyedError(
            f"the KMS key of run {run_id!r} was destroyed (tombstone "
            f"{keys.tombstone_alias_of(run_id)} in {keys.location}); every generation of this "
            "run is unreadable and no new generation can be saved under this run id. Start a "
            "new run id."
        )


def destroy(keys: RunKeys, run_id: str, pending_window_days: int) -> KeyInfo:
    """Tombstone first, then disable every key of the run (the current one and a
    retired one of an unfinished rotation) and schedule its deletion. Idempotent:
    a second call finishes what an interrupted one started."""
    keys.require_per_run("crypto-erase of one run")
    current = keys.current_key(run_id)
    tombstoned = is_destroyed(keys, run_id)
    if current is None and not tombstoned:
        raise UsageError(f"key store {keys.location} holds no key for run {run_id!r}")
    if not tombstoned:
        _record_tombstone(keys, run_id)
    keys.forget_verified()
    if current is None:  # deleted by KMS after an earlier destroy's window
        return KeyInfo(run_id, "deleted", "unknown", "unknown (the key is already deleted)")
    tags = keys.client.tags(current)
    destroyed_at = tags.get(TAG_DESTROYED) or _now()
    # Also a retired key of an unfinished rotation, and a new key an interrupted
    # rotation made but never used.
    doomed = [current] + [tags[t] for t in (TAG_ROTATED_FROM, TAG_ROTATING_TO) if tags.get(t)]
    deleted_after = None
    for key in doomed:
        when = schedule_deletion(keys, key, {TAG_DESTROYED: destroyed_at}, pending_window_days)
        deleted_after = when or deleted_after
    return KeyInfo(run_id, current, tags.get(TAG_CREATED, "unknown"), destroyed_at, deleted_after)


def _record_tombstone(keys: RunKeys, run_id: str) -> None:
    holder = _tombstone_holder(keys)
    try:
        keys.client.call(
            "create_alias", AliasName=keys.tombstone_alias_of(run_id), TargetKeyId=holder
        )
    except KmsFailure as failure:
        if failure.code != "AlreadyExistsException":
            raise keys.client.service_error(
                failure, f"recording the tombstone of {run_id!r}"
            ) from failure


def _tombstone_holder(keys: RunKeys) -> str:
    """The marker key the tombstone aliases point at (created disabled, once)."""
    alias = keys.alias_prefix + TOMBSTONES
    found = keys.client.describe(alias)
    if found is not None:
        return str(found["Arn"])
    created: dict[str, Any] = {}
    try:
        created = keys.client.call(
            "create_key",
            Description=(
                "ckptvault tombstones: never encrypts anything. Its aliases "
                f"({alias}/...) record which runs' keys were destroyed; deleting it "
                "would let new saves reuse a destroyed run id"
            ),
            Tags=[{"TagKey": TAG_ROLE, "TagValue": TOMBSTONES}],
        )["KeyMetadata"]
        keys.client.call("disable_key", KeyId=created["KeyId"])
        keys.client.call("create_alias", AliasName=alias, TargetKeyId=created["KeyId"])
    except KmsFailure as failure:
        if failure.code == "AlreadyExistsException" and created:  # a concurrent destroy
            retire_unused(keys.client, str(created["KeyId"]))
            return _tombstone_holder(keys)
        raise keys.client.service_error(failure, "creating the tombstone marker key") from failure
    return str(created["Arn"])


def schedule_deletion(
    keys: RunKeys, key: str, tags: dict[str, str], pending_window_days: int
) -> str | None:
    """Tag, disable and schedule the deletion of ``key``; returns the deletion
    date when KMS gives one. Already pending or already deleted is fine."""
    client = keys.client
    found = client.describe(key)
    if found is None:
        return None
    try:
        client.call(
            "tag_resource",
            KeyId=key,
            Tags=[{"TagKey": name, "TagValue": value} for name, value in tags.items()],
        )
        if found.get("KeyState") not in STATE_GONE:
            key_id = found["KeyId"]  # (some KMS emulators take only the bare id here)
            client.call("disable_key", KeyId=key_id)
            response = client.call(
                "schedule_key_deletion", KeyId=key_id, PendingWindowInDays=pending_window_days
            )
            when = response.get("DeletionDate")
        else:
            when = found.get("DeletionDate")
    except KmsFailure as failure:
        raise client.service_error(failure, f"scheduling the deletion of {key}") from failure
    return date_text(when)
