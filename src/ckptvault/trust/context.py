"""``TrustContext``: everything a process trusts and records, configured once.

It holds the signing key, the trusted public keys, the key store, the rollback
ledger and the audit log, and the rule that none of them may live inside the
checkpoint store (whoever can write the store could otherwise lower the floor,
rewrite the record, or carry the keys away with a copy). The manager, the export
and the ``keys`` commands build one from the same options, so they agree on
defaults; its :meth:`subscribers` keep the ledger and the audit log up to date from
the manager's events.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ckptvault.errors import AuditError, UsageError
from ckptvault.events import Subscriber
from ckptvault.format.layout import GenerationName
from ckptvault.storage.base import Store
from ckptvault.trust.audit import AuditLog, default_audit_path
from ckptvault.trust.checks import TrustPolicy
from ckptvault.trust.keystore import KeyInfo, KeyStore
from ckptvault.trust.keystores import open_keystore
from ckptvault.trust.ledger import Ledger, RestoreFloor, default_ledger_path
from ckptvault.trust.recorders import AuditRecorder, FloorKeeper
from ckptvault.trust.signing import (
    MANIFEST_DOMAIN,
    PrivateKeyLike,
    PublicKeyLike,
    TrustedKeys,
    key_id,
    load_private_key,
    sign,
)

PathLike = str | os.PathLike[str]


def _trusted_keys(source: Iterable[PublicKeyLike] | PublicKeyLike | None) -> TrustedKeys | None:
    if source is None:
        return None
    if isinstance(source, (str, bytes, os.PathLike, Ed25519PublicKey, Ed25519PrivateKey)):
        return TrustedKeys.load([source])  # one key given alone
    return TrustedKeys.load(source)


@dataclass(frozen=True)
class TrustContext:
    signer: Ed25519PrivateKey | None = None
    trusted: TrustedKeys | None = None
    keystore: KeyStore | None = None
    ledger: Ledger | None = None
    audit: AuditLog | None = None

    @classmethod
    def configure(
        cls,
        *,
        signing_key: PrivateKeyLike | None = None,
        trusted_keys: Iterable[PublicKeyLike] | PublicKeyLike | None = None,
        keystore: PathLike | KeyStore | None = None,
        ledger: PathLike | None = None,
        audit_log: PathLike | None = None,
        always_ledger: bool = False,
        always_audit: bool = False,
    ) -> TrustContext:
        """Build from user options, with ckptvault's defaults.

        The rollback floor (and so the ledger) is on when a ledger or trusted keys
        are given; the audit log is on whenever any trust feature is. Both default
        to the per-user state directory. Export and key commands always audit.
        """
        floor_on = always_ledger or ledger is not None or trusted_keys is not None
        audit_on = always_audit or floor_on or keystore is not None or signing_key is not None
        audit_on = audit_on or audit_log is not None
        book = Ledger(ledger if ledger is not None else default_ledger_path())
        return cls(
            signer=load_private_key(signing_key) if signing_key is not None else None,
            trusted=_trusted_keys(trusted_keys),
            keystore=open_keystore(keystore) if keystore is not None else None,
            ledger=book if floor_on else None,
            audit=(
                # Beside its ledger by default: one log, one head, one ledger.
                AuditLog(audit_log if audit_log is not None else default_audit_path(book), book)
                if audit_on
                else None
            ),
        )

    # -- where control-plane state lives -------------------------------------------------

    def check_outside(self, store: Store) -> None:
        """Refuse key store, ledger or audit log inside ``store``."""
        location = getattr(self.keystore, "location", None)
        if location and "://" in location:  # a key service (kms://...), not a local path
            location = None
        places: list[tuple[str, Path | None, str]] = [
            (
                "key store",
                Path(location) if location else None,
                "keys must not live beside what they protect; a copy of the store would carry them",
            ),
            (
                "ledger",
                self.ledger.path if self.ledger else None,
                "whoever can write the store could then lower the rollback floor",
            ),
            (
                "audit log",
                self.audit.path if self.audit else None,
                "whoever can write the store could then rewrite the record of what happened",
            ),
        ]
        for what, path, why in places:
            if path is not None and store.holds_path(path):
                raise UsageError(
                    f"the {what} ({path}) is inside the checkpoint store {store.location}; {why}"
                )

    # -- what a reader insists on --------------------------------------------------------

    def floor(self, run_id: str) -> RestoreFloor | None:
        """The run's restore floor, or None when the floor is off."""
        return self.ledger.floor(run_id) if self.ledger is not None else None

    def published(self, run_id: str) -> list[GenerationName]:
        """The run's newest publishes the ledger remembers (none without a ledger)."""
        if self.ledger is None:
            return []
        return [GenerationName(step, gid) for step, gid in self.ledger.published(run_id)]

    def recorded_marks(self, run_id: str) -> set[GenerationName] | None:
        """The deletion marks ckptvault made for the run, per the ledger; None without
        a ledger (then the store's marks are all there is to go by)."""
        if self.ledger is None:
            return None
        return {GenerationName(step, gid) for step, gid in self.ledger.marks(run_id)}

    def policy(self, run_id: str | None, floor: RestoreFloor | None) -> TrustPolicy:
        """What restore insists on, for any reader that decides about a generation
        (retention, gc, replication, export): the run, the floor, the trusted keys, and
        the run's key (``authenticate``: an encrypted manifest's MAC must check)."""
        return TrustPolicy(
            run_id=run_id,
            trusted_keys=self.trusted,
            floor=floor,
            keystore=self.keystore,
            authenticate=True,
        )

    # -- what a writer does --------------------------------------------------------------

    @property
    def signer_id(self) -> str | None:
        return key_id(self.signer.public_key()) if self.signer is not None else None

    def sign_manifest(self, manifest: bytes) -> bytes | None:
        """The detached signature of a manifest's exact bytes, or None when unsigned."""
        return sign(self.signer, manifest, MANIFEST_DOMAIN) if self.signer is not None else None

    def ensure_key_usable(self, run_id: str) -> None:
        """KeyDestroyedError when the run was crypto-erased; nothing without a key store."""
        if self.keystore is not None:
            self.keystore.ensure_usable(run_id)

    def destroy_run_key(self, run_id: str) -> KeyInfo:
        """Crypto-erase a run and record it in the audit log."""
        if self.keystore is None:
            raise UsageError("destroying a run's key needs a key store")
        info = self.keystore.destroy(run_id)
        self.record(
            f"the key of run {run_id!r} was destroyed",
            "key_destroyed",
            run_id=run_id,
            kek_id=info.kek_id,
            keystore=self.keystore.location,
        )
        return info

    # -- records -----------------------------------------------------------------------

    def record(self, done: str, event: str, **fields: Any) -> None:
        """Append to the audit log (when on) after the fact; a failure says what
        already happened."""
        if self.audit is None:
            return
        try:
            self.audit.append(event, **fields)
        except AuditError as exc:
            raise AuditError(f"{done}, but recording it in the audit log failed: {exc}") from exc

    def subscribers(self) -> list[Subscriber]:
        """Event subscribers that keep the ledger's floor and the audit log current."""
        subscribers: list[Subscriber] = []
        if self.ledger is not None:
            subscribers.append(FloorKeeper(self.ledger))
        if self.audit is not None:
            subscribers.append(AuditRecorder(self))
        return subscribers
