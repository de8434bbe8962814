"""Key rotation: a new KEK for a run, without rewriting a single tensor file.

Envelope encryption makes this cheap: a generation's data is encrypted under data
keys that the manifest holds only wrapped by the run's KEK, so rotating the KEK
means re-wrapping a few dozen bytes per file in each manifest; the data files and
their digests stay exactly as they are. :func:`rotate_run_key`:

1. opens every store given (a run's replicas hold copies of its generations: a copy
   left out becomes unreadable once the old KEK is destroyed), takes each store's
   writer lock (no save is in flight while keys move; ``StoreLockedError`` while a
   trainer holds a store), and reads every manifest;
2. refuses, before anything changes, a run whose generations are signed when no
   signing key is given: a manifest whose bytes change needs a new signature;
3. asks the key store for a new KEK (:meth:`RotatingKeyStore.begin_rotation
   <ckptvault.trust.keystore.RotatingKeyStore.begin_rotation>`; the old one is kept
   *retired*, still able to unwrap), or resumes the unfinished rotation;
4. for each generation of the run still under the retired KEK: verifies it
   completely — the restore checks, every byte against its digests, the manifest's
   MAC, every data key unwrapping, and a signature by ``signing_key`` or a trusted
   key — re-wraps its keys (:func:`~ckptvault.trust.rewrap.rewrap_manifest`),
   re-signs it, and replaces its manifest (``Store.replace_manifest``, signature
   first). The same generation in several stores gets the same new bytes, so
   replicas stay identical. Generations already under the new KEK are skipped:
   rotation is idempotent and resumable;
5. when every generation that needed the retired KEK has moved, destroys it
   (:meth:`~ckptvault.trust.keystore.RotatingKeyStore.finish_rotation`) and records
   one ``key_rotated`` entry in the audit log with the counts. Otherwise the retired
   KEK stays (the run stays readable) and a rerun finishes the job.

A generation that fails verification is left as it is, and keeps the retired KEK
alive: fix or delete it, or pass ``abandon_unverified=True`` to destroy the retired
KEK anyway (that generation becomes unreadable). A crash at any point leaves every
generation readable, wrapped by either KEK; only a signed generation caught between
its two writes (new signature, old manifest) is refused by signature checks until
the rotation resumes — the rotation journal (:mod:`ckptvault.ops.rotation_journal`)
lets the resumed rotation finish it without trusting an unverifiable signature.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blake3 import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ckptvault.errors import (
    AuditError,
    CheckpointError,
    FormatError,
    KeyDestroyedError,
    KeyServiceError,
    SignatureError,
    StoreLockedError,
    UsageError,
)
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME
from ckptvault.format.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from ckptvault.ops.rotation_journal import RotationJournal, journal_path
from ckptvault.storage import S3Options, StoreLocation, open_store
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import (
    MAX_SIGNATURE_BYTES,
    TrustPolicy,
    check_digests,
    check_structure,
)
from ckptvault.trust.context import TrustContext
from ckptvault.trust.keystore import KeyStore, RotatingKeyStore, RotationKeys
from ckptvault.trust.ledger import default_state_dir
from ckptvault.trust.manifest_auth import authenticate_manifest
from ckptvault.trust.problems import GenerationRejected
from ckptvault.trust.rewrap import rewrap_manifest
from ckptvault.trust.signing import (
    MANIFEST_DOMAIN,
    PrivateKeyLike,
    PublicKeyLike,
    TrustedKeys,
    sign,
    verify,
)

ROTATED = "rotated"
ALREADY_ROTATED = "already-rotated"
SKIPPED = "skipped"
FAILED = "failed"
NOT_REACHED = "not-reached"  # stop_after ended the run first


@dataclass(frozen=True)
class GenerationOutcome:
    store: str
    step: int
    generation_id: str
    outcome: str  # one of the constants above
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "step": self.step,
            "generation_id": self.generation_id,
            "outcome": self.outcome,
            "detail": self.detail,
        }


@dataclass
class RotationReport:
    """What one call of :func:`rotate_run_key` did."""

    run_id: str
    keystore: str
    new_kek_id: str
    retired_kek_ids: list[str]
    resumed: bool  # an unfinished rotation was found and continued
    finished: bool = False  # the retired KEK was destroyed
    destroyed_kek_ids: list[str] = field(default_factory=list)
    generations: list[GenerationOutcome] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(1 for g in self.generations if g.outcome == outcome)

    def counts(self) -> dict[str, int]:
        return {
            name: self.count(name)
            for name in (ROTATED, ALREADY_ROTATED, SKIPPED, FAILED, NOT_REACHED)
        }

    def to_json(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "keystore": self.keystore,
            "new_kek_id": self.new_kek_id,
            "retired_kek_ids": self.retired_kek_ids,
            "resumed": self.resumed,
            "finished": self.finished,
            "destroyed_kek_ids": self.destroyed_kek_ids,
            "counts": self.counts(),
            "generations": [g.to_json() for g in self.generations],
        }


@dataclass
class _Found:
    """One listed generation and what its (not yet verified) manifest says."""

    store: Store
    ref: GenerationRef
    manifest: Manifest | None = None
    signed: bool = False
    problem: str | None = None  # why its manifest could not be read or parsed
    unreadable: bool = False  # the problem is I/O, not content: never skip it silently


def rotate_run_key(
    stores: StoreLocation | Store | Sequence[StoreLocation | Store],
    run_id: str,
    keystore: str | os.PathLike[str] | KeyStore,
    *,
    signing_key: PrivateKeyLike | None = None,
    trusted_keys: Iterable[PublicKeyLike] | None = None,
    ledger: str | os.PathLike[str] | None = None,
    audit_log: str | os.PathLike[str] | None = None,
    s3: S3Options | None = None,
    stop_after: int | None = None,
    abandon_unverified: bool = False,
    journal_dir: str | os.PathLike[str] | None = None,
) -> RotationReport:
    """Rotate the KEK of ``run_id`` and re-wrap every generation of it in ``stores``
    (see the module docstring). ``stop_after=N`` stops after N generations were
    re-wrapped (an interrupted rotation, resumable: the retired KEK is kept).
    The audit log and the journal default to the per-user state directory, beside
    the ledger."""
    if stop_after is not None and stop_after < 0:
        raise UsageError(f"stop_after must be a count of generations, not {stop_after}")
    trust = TrustContext.configure(
        signing_key=signing_key,
        keystore=keystore,
        ledger=ledger,
        audit_log=audit_log,
        always_audit=True,
    )
    rotating = trust.keystore
    if not isinstance(rotating, RotatingKeyStore):
        raise UsageError(
            f"key store {getattr(rotating, 'location', rotating)!r} cannot rotate keys"
        )
    trusted = _trusted(trust.signer, trusted_keys)
    journal_file = journal_path(_journal_dir(journal_dir, ledger), run_id)
    opened = _open_stores(stores, s3)
    for store in opened:
        trust.check_outside(store)
        if store.holds_path(journal_file):
            raise UsageError(f"the rotation journal {journal_file} is inside {store.location}")
    locked: list[Store] = []
    rotation: _Rotation | None = None
    try:
        for store in opened:
            _lock(store)
            locked.append(store)
        found = [item for store in opened for item in _survey(store)]
        _refuse_signed_without_key(found, run_id, trust.signer)
        keys = rotating.begin_rotation(run_id)
        journal = RotationJournal(journal_file, run_id, keys.new_kek_id)
        rotation = _Rotation(run_id, rotating, keys, trust.signer, trusted, journal)
        report = rotation.run(found, stop_after)
        blocking = report.count(FAILED) and not abandon_unverified
        if not blocking and not report.count(NOT_REACHED):
            report.destroyed_kek_ids = rotating.finish_rotation(run_id)
            report.finished = True
            rotation.journal.remove()
    except BaseException as exc:
        if rotation is not None:  # keys may have moved already: that goes on record too
            with contextlib.suppress(AuditError):
                _record(trust, rotation.report, opened, f"{type(exc).__name__}: {exc}")
        raise
    finally:
        for store in locked:
            store.release_writer()
    _record(trust, report, opened)
    return report


def _record(
    trust: TrustContext, report: RotationReport, stores: list[Store], error: str | None = None
) -> None:
    """One audit entry per rotation run, with its counts."""
    done = "rotated" if report.finished else "rotated in part"
    fields: dict[str, Any] = {"error": error} if error is not None else {}
    trust.record(
        f"the key of run {report.run_id!r} was {done}",
        "key_rotated",
        run_id=report.run_id,
        keystore=report.keystore,
        new_kek_id=report.new_kek_id,
        retired_kek_ids=report.retired_kek_ids,
        destroyed_kek_ids=report.destroyed_kek_ids,
        resumed=report.resumed,
        finished=report.finished,
        stores=[store.location for store in stores],
        **{name.replace("-", "_"): n for name, n in report.counts().items()},
        **fields,
    )


def _trusted(
    signer: Ed25519PrivateKey | None, trusted_keys: Iterable[PublicKeyLike] | None
) -> TrustedKeys | None:
    """Whose signatures rotation accepts before re-signing: the signing key's own and
    any ``trusted_keys`` (a run signed by an earlier key)."""
    sources: list[PublicKeyLike] = list(trusted_keys or [])
    if signer is not None:
        sources.append(signer.public_key())
    return TrustedKeys.load(sources) if sources else None


def _journal_dir(
    journal_dir: str | os.PathLike[str] | None, ledger: str | os.PathLike[str] | None
) -> Path:
    if journal_dir is not None:
        return Path(os.path.abspath(os.fspath(journal_dir)))
    base = Path(os.path.abspath(os.fspath(ledger))).parent if ledger else default_state_dir()
    return base / "rotations"


def _open_stores(
    stores: StoreLocation | Store | Sequence[StoreLocation | Store], s3: S3Options | None
) -> list[Store]:
    many = stores if isinstance(stores, Sequence) and not isinstance(stores, str) else [stores]
    if not many:
        raise UsageError("give at least one store holding the run's generations")
    opened = []
    for location in many:
        # S3 options go to s3:// locations only (open_store refuses them elsewhere).
        text = location if isinstance(location, Store) else os.fspath(location)
        options = s3 if isinstance(text, str) and text.startswith("s3://") else None
        opened.append(open_store(text, must_exist=True, s3=options))
    return opened


def _lock(store: Store) -> None:
    try:
        store.acquire_writer()
    except StoreLockedError as exc:
        raise StoreLockedError(
            f"{exc}. Key rotation moves keys only while no trainer writes the store: run it "
            "between training jobs (a save in flight could otherwise wrap keys with the old KEK "
            "after it was destroyed)"
        ) from None


def _survey(store: Store) -> list[_Found]:
    """Every generation of ``store`` and its manifest as stored (unverified)."""
    found = []
    for ref in store.list_generations():
        item = _Found(store, ref)
        try:
            entries = store.list_entries(ref)
            item.signed = SIGNATURE_NAME in entries
            manifest_entry = entries.get(MANIFEST_NAME)
            if manifest_entry is None or manifest_entry.size > MAX_MANIFEST_BYTES:
                raise FormatError("the manifest is missing or too large")
            data = store.read_bytes(ref, MANIFEST_NAME, manifest_entry.size)
            item.manifest = parse_manifest(data, f"{ref.location}")
        except (FormatError, CheckpointError) as exc:
            item.problem = str(exc)
        except OSError as exc:
            item.problem, item.unreadable = f"cannot be read: {exc}", True
        found.append(item)
    return found


def _refuse_signed_without_key(
    found: list[_Found], run_id: str, signer: Ed25519PrivateKey | None
) -> None:
    if signer is not None:
        return
    signed = [
        item
        for item in found
        if item.signed
        and item.manifest is not None
        and item.manifest.run_id == run_id
        and item.manifest.encryption is not None
    ]
    if signed:
        named = ", ".join(f"step {i.ref.step} in {i.store.location}" for i in signed[:5])
        raise UsageError(
            f"{len(signed)} generation(s) of run {run_id!r} are signed ({named}"
            f"{', ...' if len(signed) > 5 else ''}); rotation changes their manifests' bytes, "
            "so it must sign them again: pass --signing-key (signing_key=) with the run's "
            "signing key. Nothing was changed"
        )


class _Rotation:
    """One pass over the surveyed generations."""

    def __init__(
        self,
        run_id: str,
        keystore: RotatingKeyStore,
        keys: RotationKeys,
        signer: Ed25519PrivateKey | None,
        trusted: TrustedKeys | None,
        journal: RotationJournal,
    ) -> None:
        self.run_id = run_id
        self.keystore = keystore
        self.keys = keys
        self.signer = signer
        self.trusted = trusted
        self.journal = journal
        # (generation id, BLAKE3 of the old manifest) -> new manifest and signature, so
        # a generation held by several stores gets the same bytes in each.
        self.made: dict[tuple[str, str], tuple[bytes, bytes | None]] = {}
        self.report = RotationReport(
            run_id, keystore.location, keys.new_kek_id, list(keys.retired_kek_ids), keys.resumed
        )

    def run(self, found: list[_Found], stop_after: int | None) -> RotationReport:
        report = self.report
        for item in found:
            if stop_after is not None and report.count(ROTATED) >= stop_after:
                outcome, detail = self._classify(item)
                if outcome is None:
                    outcome, detail = NOT_REACHED, "stop_after reached first"
            else:
                outcome, detail = self._classify(item)
                if outcome is None:
                    outcome, detail = self._rotate(item)
            report.generations.append(
                GenerationOutcome(
                    item.store.location, item.ref.step, item.ref.generation_id, outcome, detail
                )
            )
        return report

    def _classify(self, item: _Found) -> tuple[str | None, str]:
        """What to do with a generation before verifying it; None: re-wrap it."""
        manifest = item.manifest
        if manifest is None:
            return (FAILED if item.unreadable else SKIPPED), f"manifest {item.problem}"
        if manifest.run_id != self.run_id:
            return SKIPPED, f"a generation of run {manifest.run_id!r}"
        if manifest.encryption is None:
            return SKIPPED, "not encrypted"
        kek_id = manifest.encryption.kek_id
        if kek_id == self.keys.new_kek_id:
            return ALREADY_ROTATED, ""
        if kek_id not in self.keys.retired_kek_ids:
            return SKIPPED, (
                f"wrapped by {kek_id}, neither the new nor the retired key of this run: it "
                "was unreadable with this key store before the rotation"
            )
        return None, ""

    def _rotate(self, item: _Found) -> tuple[str, str]:
        store, ref = item.store, item.ref
        where = f"generation {ref.generation_id} (step {ref.step}) in {store.location}"
        try:
            checked = check_structure(store, ref, TrustPolicy(run_id=self.run_id))
            problems = check_digests(store, checked)
            if problems:
                raise GenerationRejected(ref, problems)
            old = checked.manifest_bytes
            authenticate_manifest(checked.manifest, old, self.keystore, where)
            signed = self._check_signature(store, ref, old)
            made_key = (ref.generation_id, blake3(old).hexdigest())
            if made_key not in self.made:
                new = rewrap_manifest(
                    old, checked.manifest, self.keystore, self.keys.new_kek_id, where
                )
                signature = None
                if signed:
                    assert self.signer is not None  # refused up front otherwise
                    signature = sign(self.signer, new, MANIFEST_DOMAIN)
                self.made[made_key] = (new, signature)
            new, signature = self.made[made_key]
            if signature is not None:
                self.journal.note(ref.generation_id, old)  # before the first write
            store.replace_manifest(ref, new, signature, replaces=old)
        except (KeyDestroyedError, KeyServiceError):
            raise  # about the whole run or the service, not this generation
        except GenerationRejected as exc:
            return FAILED, f"does not verify: {exc.reason}"
        except (CheckpointError, ValueError, OSError) as exc:
            return FAILED, f"{type(exc).__name__}: {exc}"
        return ROTATED, ""

    def _check_signature(self, store: Store, ref: GenerationRef, manifest: bytes) -> bool:
        """Whether the generation is signed; SignatureError unless its signature is
        by the signing key or a trusted key — or it is the new signature of this
        rotation beside a manifest the journal records as verified (a crash between
        the two writes)."""
        if SIGNATURE_NAME not in store.list_entries(ref):
            return False
        if self.trusted is None:  # refused up front; here for safety
            raise UsageError("a signed generation needs a signing key to be rotated")
        signature = store.read_bytes(ref, SIGNATURE_NAME, MAX_SIGNATURE_BYTES)
        try:
            verify(signature, manifest, self.trusted, MANIFEST_DOMAIN, SIGNATURE_NAME)
        except SignatureError as exc:
            if self.journal.vouches(ref.generation_id, manifest):
                return True
            raise SignatureError(
                f"{exc}; rotation re-signs only manifests signed by the signing key or a "
                "--trusted-key (pass the key that signed it as --trusted-key)"
            ) from exc
        return True


__all__ = [
    "ALREADY_ROTATED",
    "FAILED",
    "NOT_REACHED",
    "ROTATED",
    "SKIPPED",
    "GenerationOutcome",
    "RotationReport",
    "rotate_run_key",
]
