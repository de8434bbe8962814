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
the rotation resumes — the rotation journal (:mod:`ckptvault.ops.rotation.journal`)
lets the resumed rotation finish it without trusting an unverifiable signature.

This module is the orchestration: stores, locks, the loop, finishing and the audit
entry. The survey and the refusals before anything changes are in
:mod:`~ckptvault.ops.rotation.survey`, the steps for one generation in
:mod:`~ckptvault.ops.rotation.steps`, the report in
:mod:`~ckptvault.ops.rotation.report`.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ckptvault.errors import AuditError, StoreLockedError, UsageError
from ckptvault.ops.rotation.journal import RotationJournal, journal_path
from ckptvault.ops.rotation.report import (
    ALREADY_ROTATED,
    FAILED,
    NOT_REACHED,
    ROTATED,
    SKIPPED,
    GenerationOutcome,
    RotationReport,
)
from ckptvault.ops.rotation.steps import GenerationRotator
from ckptvault.ops.rotation.survey import (
    SurveyedGeneration,
    refuse_signed_without_key,
    survey,
)
from ckptvault.progress import Meter, Progress
from ckptvault.storage import RemoteOptions, S3Options, StoreLocation, open_store
from ckptvault.storage.base import Store
from ckptvault.trust.context import TrustContext
from ckptvault.trust.keystore import KeyStore, RotatingKeyStore
from ckptvault.trust.ledger import default_state_dir
from ckptvault.trust.signing import PrivateKeyLike, PublicKeyLike, TrustedKeys


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
    progress: Progress | None = None,
) -> RotationReport:
    """Rotate the KEK of ``run_id`` and re-wrap every generation of it in ``stores``
    (see the module docstring). ``stop_after=N`` stops after N generations were
    re-wrapped (an interrupted rotation, resumable: the retired KEK is kept).
    The audit log and the journal default to the per-user state directory, beside
    the ledger. ``progress(done, total)`` counts the run's generations (in every
    store) as each is dealt with: verified and re-wrapped, skipped or failed."""
    if stop_after is not None and stop_after < 0:
        raise UsageError(f"stop_after must be a count of generations, not {stop_after}")
    trust = TrustContext.configure(
        signing_key=signing_key,
        keystore=keystore,
        ledger=ledger,
        audit_log=audit_log,
        always_audit=True,
    )
    rotating = _rotating_keystore(trust)
    trusted = _trusted(trust.signer, trusted_keys)
    journal_file = journal_path(_journal_dir(journal_dir, ledger), run_id)
    opened = _open_stores(stores, s3)
    _check_outside(opened, trust, journal_file)
    with _writer_locks(opened):
        found = [item for store in opened for item in survey(store)]
        refuse_signed_without_key(found, run_id, trust.signer)
        keys = rotating.begin_rotation(run_id)
        journal = RotationJournal(journal_file, run_id, keys.new_kek_id)
        rotator = GenerationRotator(run_id, rotating, keys, trust.signer, trusted, journal)
        meter = Meter(progress, len(found))
        report = _rotate_and_finish(
            trust, rotator, found, opened, stop_after, abandon_unverified, meter
        )
    _record(trust, report, opened)
    return report


def _rotate_and_finish(
    trust: TrustContext,
    rotator: GenerationRotator,
    found: list[SurveyedGeneration],
    stores: list[Store],
    stop_after: int | None,
    abandon_unverified: bool,
    meter: Meter,
) -> RotationReport:
    """Every generation in turn, then the retired KEK destroyed once nothing needs it
    (no failure, unless ``abandon_unverified``; nothing left unreached)."""
    keys = rotator.keys
    report = RotationReport(
        rotator.run_id,
        rotator.keystore.location,
        keys.new_kek_id,
        list(keys.retired_kek_ids),
        keys.resumed,
    )
    try:
        _rotate_each(rotator, found, stop_after, report, meter)
        blocking = report.count(FAILED) and not abandon_unverified
        if not blocking and not report.count(NOT_REACHED):
            report.destroyed_kek_ids = rotator.keystore.finish_rotation(rotator.run_id)
            report.finished = True
            rotator.journal.remove()
    except BaseException as exc:  # keys may have moved already: that goes on record too
        with contextlib.suppress(AuditError):
            _record(trust, report, stores, f"{type(exc).__name__}: {exc}")
        raise
    return report


def _rotate_each(
    rotator: GenerationRotator,
    found: list[SurveyedGeneration],
    stop_after: int | None,
    report: RotationReport,
    meter: Meter,
) -> None:
    """Each generation's outcome, into ``report`` as it comes: the ones to re-wrap are
    rotated until ``stop_after`` of them were, and not reached after that."""
    for item in found:
        outcome, detail = rotator.classify(item)
        if outcome is None:
            if stop_after is not None and report.count(ROTATED) >= stop_after:
                outcome, detail = NOT_REACHED, "stop_after reached first"
            else:
                outcome, detail = rotator.rotate(item)
        report.generations.append(
            GenerationOutcome(
                item.store.location, item.ref.step, item.ref.generation_id, outcome, detail
            )
        )
        meter(1)


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


def _rotating_keystore(trust: TrustContext) -> RotatingKeyStore:
    rotating = trust.keystore
    if not isinstance(rotating, RotatingKeyStore):
        raise UsageError(
            f"key store {getattr(rotating, 'location', rotating)!r} cannot rotate keys"
        )
    return rotating


def _check_outside(stores: list[Store], trust: TrustContext, journal_file: Path) -> None:
    """Refuse control-plane state (key store, ledger, audit log, journal) inside a
    store: whoever can write the store could forge it (a journal entry vouches for a
    signature that does not verify)."""
    for store in stores:
        trust.check_outside(store)
        if store.holds_path(journal_file):
            raise UsageError(f"the rotation journal {journal_file} is inside {store.location}")


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
        opened.append(open_store(text, must_exist=True, **RemoteOptions(s3=s3).for_location(text)))
    return opened


@contextlib.contextmanager
def _writer_locks(stores: list[Store]) -> Iterator[None]:
    """Every store's writer lock, taken in order and released whatever happens."""
    locked: list[Store] = []
    try:
        for store in stores:
            _lock(store)
            locked.append(store)
        yield
    finally:
        for store in locked:
            store.release_writer()


def _lock(store: Store) -> None:
    try:
        store.acquire_writer()
    except StoreLockedError as exc:
        raise StoreLockedError(
            f"{exc}. Key rotation moves keys only while no trainer writes the store: run it "
            "between training jobs (a save in flight could otherwise wrap keys with the old KEK "
            "after it was destroyed)"
        ) from None


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
