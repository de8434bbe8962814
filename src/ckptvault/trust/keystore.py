"""Key stores: where each run's key-encryption key (KEK) lives, and how it dies.

Every encrypted file has its own random data key; the data key is stored in the
manifest only wrapped (encrypted) by the run's KEK. Destroying the KEK therefore
makes every generation and every copy of the run unreadable at once: crypto-erase.

The :class:`KeyStore` protocol wraps and unwraps data keys rather than handing out
the KEK, so a cloud KMS (whose keys never leave it) implements it too
(:mod:`ckptvault.trust.kms.keystore`, ``kms://`` URLs). :class:`LocalKeyStore` keeps
each KEK as a 0600 file in a directory that must live outside the checkpoint store,
and leaves a tombstone when a key is destroyed.

A :class:`RotatingKeyStore` can also give a run a new KEK without touching a tensor
file (``ckptvault.ops.rotation.rotate``): :meth:`~RotatingKeyStore.begin_rotation` makes the
new KEK current and keeps the old one *retired* (still able to unwrap, never to
wrap), :meth:`~RotatingKeyStore.rewrap` moves one wrapped key from the retired KEK
to the current one under the same context, and
:meth:`~RotatingKeyStore.finish_rotation` destroys the retired KEK once nothing
needs it. ``begin_rotation`` resumes an unfinished rotation instead of starting a
second one, so a run has at most one retired KEK at a time.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from blake3 import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ckptvault.durable import fsync_directory, make_dirs_durable, write_atomically
from ckptvault.errors import KeyDestroyedError, KeyUnavailableError, UsageError
from ckptvault.format.layout import utc_now as _now

_WRAP_DOMAIN = b"ckptvault key wrap v1\0"
_NONCE_BYTES = 12


@dataclass(frozen=True)
class KeyInfo:
    run_id: str
    kek_id: str
    created_at: str
    destroyed_at: str | None = None
    # When the key material itself goes, where that is later than destroyed_at (a
    # KMS deletes a key only after its pending window); None otherwise.
    deleted_after: str | None = None

    def to_json(self) -> dict[str, str | None]:
        document = {
            "run_id": self.run_id,
            "kek_id": self.kek_id,
            "created_at": self.created_at,
            "destroyed_at": self.destroyed_at,
        }
        if self.deleted_after is not None:
            document["deleted_after"] = self.deleted_after
        return document


@dataclass(frozen=True)
class RotationKeys:
    """Where a run's key rotation stands: the KEK that wraps from now on, the retired
    KEK(s) whose wrapped keys still have to move, and whether an unfinished rotation
    was found and resumed rather than a new one started."""

    run_id: str
    new_kek_id: str
    retired_kek_ids: tuple[str, ...]
    resumed: bool = False


class KeyStore(Protocol):
    location: str

    def wrap(self, run_id: str, data_key: bytes, context: bytes) -> tuple[str, bytes]:
        """Wrap ``data_key`` under the run's KEK (created on first use).

        Returns ``(kek id, wrapped key)``; raises KeyDestroyedError after destroy."""

    def unwrap(self, run_id: str, kek_id: str, wrapped: bytes, context: bytes) -> bytes:
        """Recover a data key; raises KeyDestroyedError or KeyUnavailableError."""

    def is_destroyed(self, run_id: str) -> bool: ...

    def ensure_usable(self, run_id: str) -> None:
        """Raise KeyDestroyedError if the run's key was destroyed."""

    def destroy(self, run_id: str) -> KeyInfo: ...

    def list_keys(self) -> list[KeyInfo]: ...


@runtime_checkable
class RotatingKeyStore(KeyStore, Protocol):
    """A key store that can give a run a new KEK (see the module docstring)."""

    def begin_rotation(self, run_id: str) -> RotationKeys:
        """Make a new KEK current and retire the old one; or, when a rotation of the
        run is unfinished, return it unchanged (``resumed=True``). UsageError when
        the run has no key; KeyDestroyedError after destroy."""

    def rewrap(self, run_id: str, kek_id: str, wrapped: bytes, context: bytes) -> tuple[str, bytes]:
        """``wrapped`` (under ``kek_id``, with ``context``) wrapped by the current KEK
        under the same context: ``(current KEK id, wrapped key)``. Raises as unwrap."""

    def finish_rotation(self, run_id: str) -> list[str]:
        """Destroy the retired KEK(s); returns their ids (none when no rotation was
        unfinished). Everything still wrapped by them becomes unreadable."""


class LocalKeyStore:
    """KEKs as 0600 files in a directory (created 0700), one per run id."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(os.path.abspath(os.fspath(directory)))
        self.location = str(self.directory)

    # -- paths ------------------------------------------------------------------------

    def _stem(self, run_id: str) -> Path:
        # Hashed names: run ids may hold any character, none reaches the filesystem.
        return self.directory / blake3(run_id.encode("utf-8")).hexdigest()[:40]

    def _key_path(self, run_id: str) -> Path:
        return self._stem(run_id).with_suffix(".kek")

    def _tombstone_path(self, run_id: str) -> Path:
        return self._stem(run_id).with_suffix(".tombstone")

    def _retired_path(self, run_id: str) -> Path:
        """The KEK a rotation retired, kept (it still unwraps) until it finishes."""
        return self._stem(run_id).with_suffix(".retired")

    # -- reading ----------------------------------------------------------------------

    def is_destroyed(self, run_id: str) -> bool:
        return self._tombstone_path(run_id).exists()

    def ensure_usable(self, run_id: str) -> None:
        if self.is_destroyed(run_id):
            raise self._destroyed_error(run_id)

    def _check_private(self, path: Path, mode: int) -> None:
        """Refuse a key store that others could have written: keys or directory that
        are group/other-writable, or key files readable by others or owned by another
        user (someone could have planted a KEK of their choosing)."""
        info = path.stat()
        if info.st_mode & mode or (hasattr(os, "getuid") and info.st_uid != os.getuid()):
            raise KeyUnavailableError(
                f"{path} has unsafe permissions ({oct(info.st_mode & 0o777)}, owner uid "
                f"{info.st_uid}); a key store must be private to its user. Fix with chmod "
                "700 on the directory and 600 on key files, or use another key store"
            )

    def _tombstone(self, run_id: str) -> KeyInfo:
        path = self._tombstone_path(run_id)
        try:
            raw = json.loads(path.read_text())
            return KeyInfo(raw["run_id"], raw["kek_id"], raw["created_at"], raw["destroyed_at"])
        except (OSError, ValueError, KeyError, TypeError):
            # A damaged tombstone still means destroyed: the key is never used again.
            return KeyInfo(
                run_id, "unknown", "unknown", f"unknown (tombstone {path.name} is damaged)"
            )

    def _destroyed_error(self, run_id: str) -> KeyDestroyedError:
        info = self._tombstone(run_id)
        return KeyDestroyedError(
            f"the key of run {run_id!r} ({info.kek_id}) was destroyed at {info.destroyed_at} "
            f"(tombstone in {self.location}); every generation of this run is unreadable and "
            "no new generation can be saved under this run id. Start a new run id."
        )

    def _read_key(self, run_id: str, path: Path | None = None) -> tuple[str, bytes] | None:
        path = path or self._key_path(run_id)
        if not path.exists():
            return None
        self._check_private(self.directory, 0o022)
        self._check_private(path, 0o077)
        try:
            raw = json.loads(path.read_text())
            key = base64.b64decode(raw["key"], validate=True)
            if raw["run_id"] != run_id or len(key) != 32:
                raise ValueError("it does not hold a 256-bit key for this run")
            return str(raw["kek_id"]), key
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise KeyUnavailableError(
                f"key file {path} for run {run_id!r} is unreadable or malformed ({exc}); restore "
                "it from the key store's backup: without it the run cannot be read"
            ) from exc

    def _get_or_create(self, run_id: str) -> tuple[str, bytes]:
        if self.is_destroyed(run_id):
            raise self._destroyed_error(run_id)
        existing = self._read_key(run_id)
        if existing is not None:
            return existing
        # Durably: a generation this key unlocks may be published (and fsync'd) next,
        # and a key store that a power cut takes back would take those generations too.
        make_dirs_durable(self.directory, mode=0o700)
        self._check_private(self.directory, 0o022)
        kek_id = "kek-" + secrets.token_hex(8)
        key = AESGCM.generate_key(bit_length=256)
        document = {
            "run_id": run_id,
            "kek_id": kek_id,
            "key": base64.b64encode(key).decode("ascii"),
            "created_at": _now(),
        }
        # The whole key is written under a private name, then linked into place:
        # link() fails if the name exists, so concurrent creators agree on one key and
        # no reader ever sees a half-written file.
        try:
            write_atomically(
                self._key_path(run_id),
                json.dumps(document).encode(),
                mode=0o600,
                replace=False,
            )
        except FileExistsError:  # another writer created it first: use theirs
            created = self._read_key(run_id)
            assert created is not None
            return created
        return kek_id, key

    # -- the KeyStore protocol -----------------------------------------------------------

    def wrap(self, run_id: str, data_key: bytes, context: bytes) -> tuple[str, bytes]:
        kek_id, kek = self._get_or_create(run_id)
        nonce = os.urandom(_NONCE_BYTES)
        wrapped = AESGCM(kek).encrypt(nonce, data_key, _WRAP_DOMAIN + context)
        return kek_id, nonce + wrapped

    def unwrap(self, run_id: str, kek_id: str, wrapped: bytes, context: bytes) -> bytes:
        if self.is_destroyed(run_id):
            raise self._destroyed_error(run_id)
        found = self._read_key(run_id)
        if found is None or found[0] != kek_id:  # a rotation may have retired it
            found = self._read_key(run_id, self._retired_path(run_id))
        if found is None or found[0] != kek_id:
            raise KeyUnavailableError(
                f"key store {self.location} has no key {kek_id} for run {run_id!r}; restore "
                "with the key store the run was saved with"
            )
        try:
            return AESGCM(found[1]).decrypt(
                wrapped[:_NONCE_BYTES], wrapped[_NONCE_BYTES:], _WRAP_DOMAIN + context
            )
        except InvalidTag:
            raise KeyUnavailableError(
                f"a wrapped data key of run {run_id!r} does not open with {kek_id} (it was "
                "edited, or belongs to another file or generation)"
            ) from None

    def destroy(self, run_id: str) -> KeyInfo:
        """Destroy the run's KEK and leave a tombstone; idempotent."""
        if self.is_destroyed(run_id):
            info = self._tombstone(run_id)
        else:
            try:
                raw = json.loads(self._key_path(run_id).read_text())
            except FileNotFoundError:
                raise UsageError(
                    f"key store {self.location} holds no key for run {run_id!r}"
                ) from None
            except (OSError, ValueError):
                raw = {}  # destroy even a damaged key file
            if not isinstance(raw, dict):
                raw = {}
            info = KeyInfo(
                run_id, str(raw.get("kek_id", "unknown")), str(raw.get("created_at", "")), _now()
            )
            # The tombstone is durable before the key goes: a crash in between still
            # reads as destroyed, and the next destroy finishes the job.
            write_atomically(
                self._tombstone_path(run_id), json.dumps(info.to_json()).encode(), mode=0o600
            )
        for path in (self._key_path(run_id), self._retired_path(run_id)):
            self._wipe(path)
        return info

    def _wipe(self, path: Path) -> None:
        """Overwrite a key file, then unlink it (best effort on flash); missing is fine."""
        if not path.exists():
            return
        size = path.stat().st_size
        with open(path, "r+b") as handle:
            handle.write(b"\0" * size)
            handle.flush()
            os.fsync(handle.fileno())
        path.unlink()
        fsync_directory(self.directory)

    # -- rotation (RotatingKeyStore) -------------------------------------------------

    def begin_rotation(self, run_id: str) -> RotationKeys:
        """The old KEK file is copied to ``<run>.retired`` (durably, first), then a new
        KEK replaces ``<run>.kek`` atomically. A crash between the two leaves the
        retired copy equal to the current key, and the next call makes the new key."""
        if self.is_destroyed(run_id):
            raise self._destroyed_error(run_id)
        current = self._read_key(run_id)
        if current is None:
            raise UsageError(
                f"key store {self.location} holds no key for run {run_id!r}; nothing to rotate"
            )
        retired_path = self._retired_path(run_id)
        retired = self._read_key(run_id, retired_path)
        resumed = retired is not None and retired[0] != current[0]
        if retired is None:
            document = json.loads(self._key_path(run_id).read_text())
            document["retired_at"] = _now()
            with contextlib.suppress(FileExistsError):  # a concurrent rotation was first
                write_atomically(
                    retired_path, json.dumps(document).encode(), mode=0o600, replace=False
                )
            retired = self._read_key(run_id, retired_path)
            assert retired is not None
        if retired[0] == current[0]:
            kek_id = "kek-" + secrets.token_hex(8)
            document = {
                "run_id": run_id,
                "kek_id": kek_id,
                "key": base64.b64encode(AESGCM.generate_key(bit_length=256)).decode("ascii"),
                "created_at": _now(),
            }
            write_atomically(self._key_path(run_id), json.dumps(document).encode(), mode=0o600)
            current = self._read_key(run_id)
            assert current is not None
        return RotationKeys(run_id, current[0], (retired[0],), resumed)

    def rewrap(self, run_id: str, kek_id: str, wrapped: bytes, context: bytes) -> tuple[str, bytes]:
        return self.wrap(run_id, self.unwrap(run_id, kek_id, wrapped, context), context)

    def finish_rotation(self, run_id: str) -> list[str]:
        retired_path = self._retired_path(run_id)
        try:
            retired = self._read_key(run_id, retired_path)
        except KeyUnavailableError:
            retired = None  # damaged: destroy it all the same
        if retired is None and not retired_path.exists():
            return []
        current = self._read_key(run_id)
        if retired is not None and current is not None and current[0] == retired[0]:
            raise UsageError(
                f"the rotation of run {run_id!r} in {self.location} has not made its new key "
                "yet; run begin_rotation first"
            )
        self._wipe(retired_path)
        return [retired[0] if retired is not None else "unknown"]

    def list_keys(self) -> list[KeyInfo]:
        if not self.directory.is_dir():
            return []
        infos: dict[str, KeyInfo] = {}
        for path in sorted(self.directory.iterdir()):
            try:
                raw = json.loads(path.read_text())
                run_id, kek_id = str(raw["run_id"]), str(raw["kek_id"])
                created, destroyed = str(raw["created_at"]), raw.get("destroyed_at")
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue  # not one of ours
            if path.suffix == ".kek":
                infos.setdefault(run_id, KeyInfo(run_id, kek_id, created))
            elif path.suffix == ".tombstone":
                infos[run_id] = KeyInfo(run_id, kek_id, created, destroyed)
        return sorted(infos.values(), key=lambda info: info.run_id)

