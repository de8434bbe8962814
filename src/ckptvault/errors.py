"""The exception hierarchy of ckptvault.

Every failure ckptvault reports is a :class:`CheckpointError`. Messages follow one
rule: say what is wrong, where (store, generation, file, key path) and what to do.
A failure never damages a generation that was already published.

This module imports nothing heavy, so that tools which only inspect stores (the CLI's
``ls`` and ``verify``) can use it without importing torch.
"""

from __future__ import annotations

from collections.abc import Sequence


class CheckpointError(Exception):
    """Base class of every error ckptvault raises."""


class IntegrityError(CheckpointError):
    """Bytes on storage do not match what the manifest promises (size or digest)."""


class UnsafeEntryError(IntegrityError):
    """An entry of the store is not what ckptvault wrote there: a symlink, a hard
    link, a FIFO or a directory where a plain file or directory belongs. ckptvault
    never follows, opens or writes through such an entry."""


class DecryptionError(IntegrityError):
    """An encrypted segment failed authentication: edited, reordered, truncated, or
    moved from another file, generation or run."""


class FormatError(CheckpointError):
    """A manifest or tensor file is malformed, or written by a newer format version."""


class UnsupportedValueError(FormatError, TypeError):
    """A state value has a type the pickle-free codec cannot represent.

    Raised at save time, before anything is written; ``path`` is the key path of the
    offending value (for example ``state["meta"]["callback"]``).
    """

    def __init__(self, path: str, value: object, hint: str = "") -> None:
        self.path = path
        self.value_type = type(value).__qualname__
        module = type(value).__module__
        qualified = self.value_type if module == "builtins" else f"{module}.{self.value_type}"
        message = (
            f"cannot checkpoint {path}: values of type {qualified} are not supported by "
            "ckptvault's pickle-free format. Store tensors, plain JSON-able values (int, "
            "float, str, bool, None, list, tuple, dict, bytes), numpy arrays, or an object "
            "with state_dict()/load_state_dict()"
        )
        if hint:
            message += f"; {hint}"
        super().__init__(message)


class NoValidCheckpoint(CheckpointError):
    """Generations exist but none passed every check.

    ``rejected`` lists ``(generation_id, step, reason)`` for every generation tried.
    """

    def __init__(self, message: str, rejected: Sequence[tuple[str, int, str]] = ()) -> None:
        self.rejected = list(rejected)
        if self.rejected:
            lines = [f"  - step {step} ({gen}): {reason}" for gen, step, reason in self.rejected]
            message = message + "\n" + "\n".join(lines)
        super().__init__(message)


class RollbackError(NoValidCheckpoint):
    """Restore found no valid generation at or above the run's restore floor, or
    (with a ledger) the step asked for is older than a newer generation that verifies,
    or more newer generations failed than ``max_fallback`` allows.

    Raised instead of silently going back to an older step; ``rejected`` lists every
    generation tried and why. ``restore(..., allow_rollback_to=STEP)`` overrides.
    """


class SignatureError(IntegrityError):
    """A manifest signature is missing, malformed, untrusted or does not match."""


class KeyDestroyedError(CheckpointError):
    """The run's key-encryption key was destroyed (crypto-erase): nothing of the run
    can be read, and nothing new can be saved under its run id."""


class KeyUnavailableError(CheckpointError):
    """An encrypted generation's key cannot be obtained (no key store, unknown key)."""


class KeyServiceError(CheckpointError):
    """The key service (a cloud KMS) could not answer for a reason that says nothing
    about one generation: network, throttling, credentials or permissions. Restore
    stops with it instead of skipping generations whose keys may be fine."""


class AuditError(CheckpointError):
    """The audit log cannot be read or appended to (damaged, unwritable)."""


class CatalogError(CheckpointError):
    """The catalog (the SQLite record of saves and restores) cannot be opened, read or
    written (unwritable, damaged, or written by a newer ckptvault)."""


class ValidationError(CheckpointError):
    """A generation verified and loaded, but the user's check of the loaded state
    failed (``mgr.validate`` / ``ckptvault validate``)."""


class ContractMismatch(CheckpointError):
    """The run contract (config, dataset identity, ...) differs from the stored one."""

    def __init__(self, message: str, fields: Sequence[str] = ()) -> None:
        self.fields = list(fields)
        super().__init__(message)


class EnvironmentMismatch(CheckpointError):
    """The software or devices differ from those the generation was saved with, and
    ``restore(..., strict_env=True)`` asked for the same environment."""

    def __init__(self, message: str, differences: Sequence[str] = ()) -> None:
        self.differences = list(differences)
        super().__init__(message)


class StateMismatchError(CheckpointError):
    """The checkpoint's keys or shapes do not match the objects being restored into."""

    def __init__(
        self,
        message: str,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[str] = (),
    ) -> None:
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)
        super().__init__(message)


class StoreLockedError(CheckpointError):
    """Another live process holds the single-writer lock of this store."""


class StorageFullError(CheckpointError):
    """The store ran out of space (or quota) while writing; nothing was published."""


class HostMemoryError(CheckpointError):
    """Asynchronous saves' staging buffers would not fit in the memory this host has
    left, or (``async_mode="process"``) in the shared-memory filesystem they are
    staged in. ``prepare()`` and the first asynchronous save raise it before anything
    is staged, instead of letting the host swap or the OOM killer end the job.

    ``reason`` is a stable code: ``"host-memory"`` (RAM, or the memory cgroup's
    limit) or ``"shared-memory"`` (``/dev/shm``); ``needed`` and ``available`` are
    bytes."""

    def __init__(
        self, message: str, *, reason: str = "host-memory", needed: int = 0, available: int = 0
    ) -> None:
        self.reason, self.needed, self.available = reason, needed, available
        super().__init__(message)


class UsageError(CheckpointError, ValueError):
    """An argument or call sequence ckptvault cannot act on (bad step, closed manager)."""


class SaveFailedError(CheckpointError):
    """A save failed for a reason that is not one of the more specific errors."""


class CollectiveError(CheckpointError):
    """A collective among the ranks of a job failed or timed out: another rank died,
    is stuck, or failed its part of a save or restore (the message names it)."""


class PeerMessageError(CollectiveError):
    """A collective completed, but a message a rank received in it is not one
    ckptvault sends: not bounded JSON, too large, or a field of the wrong type or out
    of range (a bug, or a dishonest rank). Nothing in it was run or trusted; the
    message names the rank that sent it and the collective."""


__all__ = [
    "AuditError",
    "CatalogError",
    "CheckpointError",
    "CollectiveError",
    "ContractMismatch",
    "DecryptionError",
    "EnvironmentMismatch",
    "FormatError",
    "HostMemoryError",
    "IntegrityError",
    "KeyDestroyedError",
    "KeyServiceError",
    "KeyUnavailableError",
    "NoValidCheckpoint",
    "PeerMessageError",
    "RollbackError",
    "SaveFailedError",
    "SignatureError",
    "StateMismatchError",
    "StorageFullError",
    "StoreLockedError",
    "UnsafeEntryError",
    "UnsupportedValueError",
    "UsageError",
    "ValidationError",
]
