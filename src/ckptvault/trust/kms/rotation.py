"""Rotating a run's KEK in KMS (the :class:`RotatingKeyStore` half of ``kms://``).

:func:`begin_rotation` creates a new key for the run (tagged
``ckptvault:rotated-from`` the old one's ARN), tags the old one
``ckptvault:rotating-to`` the new one and moves the run's alias; :func:`rewrap` moves
one wrapped key with ``ReEncrypt`` (the data key never leaves KMS);
:func:`finish_rotation` disables the old key and schedules its deletion like
crypto-erase does. The two tags are the rotation's state, kept in KMS itself: a
rotation interrupted anywhere is found again by the next ``begin_rotation``, which
resumes it, reuses a new key it made but never aliased, or clears a marker left by a
rotation that had already finished.
"""

from __future__ import annotations

from ckptvault.errors import KeyUnavailableError, UsageError
from ckptvault.format.layout import utc_now as _now
from ckptvault.trust.keystore import RotationKeys
from ckptvault.trust.kms.client import STATE_GONE, KmsFailure
from ckptvault.trust.kms.erase import ensure_usable, schedule_deletion
from ckptvault.trust.kms.names import (
    TAG_RETIRED,
    TAG_ROTATED_FROM,
    TAG_ROTATING_TO,
    TAG_RUN_HASH,
    run_hash,
    run_key_description,
    run_tags,
    wrapping_context,
)
from ckptvault.trust.kms.run_keys import RunKeys


def begin_rotation(keys: RunKeys, run_id: str) -> RotationKeys:
    keys.require_per_run("rotating one run's key")
    ensure_usable(keys, run_id)
    current = keys.current_key(run_id)
    if current is None:
        raise UsageError(
            f"key store {keys.location} holds no key for run {run_id!r}; nothing to rotate"
        )
    try:
        tags = keys.client.tags(current)
        previous = tags.get(TAG_ROTATED_FROM)
        if previous:
            found = keys.client.describe(previous)
            if found is not None and found.get("KeyState") not in STATE_GONE:
                return RotationKeys(run_id, current, (previous,), resumed=True)
            # Finished, but the marker stayed (interrupted after the deletion).
            keys.client.call("untag_resource", KeyId=current, TagKeys=[TAG_ROTATED_FROM])
        successor = tags.get(TAG_ROTATING_TO)
        new_key = _usable_successor(keys, run_id, successor) if successor else None
        if new_key is None:
            new_key = _create_successor(keys, run_id, current)
        keys.client.call("update_alias", AliasName=keys.alias_of(run_id), TargetKeyId=new_key)
    except KmsFailure as failure:
        raise keys.client.service_error(failure, f"rotating the key of run {run_id!r}") from failure
    keys.forget_verified()
    return RotationKeys(run_id, new_key, (current,), resumed=False)


def _create_successor(keys: RunKeys, run_id: str, current: str) -> str:
    """A new key for the run, and ``current`` tagged with it before the alias moves,
    so that an interruption in between leaves the new key findable; KmsFailure
    for the caller to translate."""
    new_key = str(
        keys.client.call(
            "create_key",
            Description=run_key_description(run_id),
            KeyUsage="ENCRYPT_DECRYPT",
            Tags=run_tags(run_id, **{TAG_ROTATED_FROM: current}),
        )["KeyMetadata"]["Arn"]
    )
    keys.client.call(
        "tag_resource",
        KeyId=current,
        Tags=[{"TagKey": TAG_ROTATING_TO, "TagValue": new_key}],
    )
    return new_key


def _usable_successor(keys: RunKeys, run_id: str, key: str) -> str | None:
    """The new key an interrupted begin_rotation made, if it is still usable."""
    found = keys.client.describe(key)
    if found is None or found.get("KeyState") != "Enabled":
        return None
    if keys.client.tags(key).get(TAG_RUN_HASH) != run_hash(run_id):
        return None
    return str(found["Arn"])


def rewrap(
    keys: RunKeys, run_id: str, kek_id: str, wrapped: bytes, context: bytes
) -> tuple[str, bytes]:
    ensure_usable(keys, run_id)
    keys.check_key_of_run(run_id, kek_id)
    target = keys.current_key(run_id)
    if target is None:
        raise KeyUnavailableError(f"run {run_id!r} has no current KMS key to rewrap under")
    encryption_context = wrapping_context(run_id, context)
    try:
        response = keys.client.call(
            "re_encrypt",
            CiphertextBlob=bytes(wrapped),
            SourceEncryptionContext=encryption_context,
            SourceKeyId=kek_id,
            DestinationKeyId=target,
            DestinationEncryptionContext=encryption_context,
        )
    except KmsFailure as failure:
        raise keys.client.unwrap_error(run_id, kek_id, failure) from failure
    return str(response["KeyId"]), bytes(response["CiphertextBlob"])


def finish_rotation(keys: RunKeys, run_id: str, pending_window_days: int) -> list[str]:
    keys.require_per_run("rotating one run's key")
    current = keys.current_key(run_id)
    if current is None:
        return []
    previous = keys.client.tags(current).get(TAG_ROTATED_FROM)
    if not previous:
        return []
    schedule_deletion(keys, previous, {TAG_RETIRED: _now()}, pending_window_days)
    try:
        keys.client.call("untag_resource", KeyId=current, TagKeys=[TAG_ROTATED_FROM])
    except KmsFailure as failure:
        raise keys.client.service_error(
            failure, f"finishing the rotation of {run_id!r}"
        ) from failure
    keys.forget_verified()
    return [previous]
