"""Adopting signatures on an existing run: ``ckptvault sign``.

A run that started unsigned can turn on ``trusted_keys=`` only once its generations
carry signatures by a trusted key; otherwise a trusted restore refuses every
generation saved so far (``signature-missing``) and the run loses its history.
:func:`sign_generations` signs them in place:

1. takes the store's writer lock (no trainer writes meanwhile: run it between jobs;
   ``StoreLockedError`` otherwise) and chooses the generations: the newest, those of
   one step, or all (generations marked for deletion are left out, as restore leaves
   them out);
2. before anything is signed, reads their manifests and refuses (``UsageError``,
   nothing signed) a store holding generations of several runs without ``run_id``,
   and a run with encrypted generations without the run's key store (their
   manifests' MACs must be checked first, and a plaintext generation in an encrypted
   run was planted: restore refuses it, so no signature may vouch for it);
3. verifies each generation completely, as restore would (with a key store: every
   file encrypted and the manifest's MAC made with the run's key), then adds its
   ``manifest.sig``
   (:class:`~ckptvault.ops.signing.steps.GenerationSigner`); generations of another run
   and generations abandoned by an allowed rollback (per the ledger) are skipped,
   never signed;
4. records one ``signed`` entry in the audit log (beside the ledger by default): the
   signing key's id, the store, and the step and id of every generation signed.

A generation that fails verification is reported and left unsigned; the others are
still signed (each signature vouches for one generation, verified on its own), and
the report is not ``ok``. Signing vouches for what the store holds now, as the
manifests say: run it on a store only you and your trainers write.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ckptvault.errors import AuditError, StoreLockedError, UsageError
from ckptvault.ops.signing.steps import (
    FAILED,
    OUTCOMES,
    REFUSED,
    SIGNED,
    GenerationSigner,
    SignOutcome,
)
from ckptvault.progress import Meter, Progress
from ckptvault.restoring.selector import CandidateSelector
from ckptvault.storage import S3Options, StoreLocation, open_store
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import TrustPolicy, check_structure
from ckptvault.trust.context import TrustContext
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.problems import GenerationRejected
from ckptvault.trust.signing import PrivateKeyLike, PublicKeyLike, TrustedKeys


@dataclass
class SignReport:
    """What one call of :func:`sign_generations` did, generation by generation."""

    store: str
    run_id: str
    key_id: str
    generations: list[SignOutcome] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(1 for g in self.generations if g.outcome == outcome)

    def counts(self) -> dict[str, int]:
        return {name: self.count(name) for name in OUTCOMES}

    @property
    def ok(self) -> bool:
        """No generation failed or was refused (skipped ones are not this run's)."""
        return not (self.count(FAILED) or self.count(REFUSED))

    def to_json(self) -> dict[str, Any]:
        return {
            "store": self.store,
            "run_id": self.run_id,
            "key_id": self.key_id,
            "ok": self.ok,
            "counts": self.counts(),
            "generations": [
                {
                    "step": g.step,
                    "generation_id": g.generation_id,
                    "path": g.path,
                    "outcome": g.outcome,
                    "detail": g.detail,
                }
                for g in self.generations
            ],
        }


def sign_generations(
    store: StoreLocation | Store,
    signing_key: PrivateKeyLike,
    *,
    step: int | None = None,
    every: bool = False,
    run_id: str | None = None,
    replace_signatures: bool = False,
    trusted_keys: Iterable[PublicKeyLike] | None = None,
    keystore: str | os.PathLike[str] | KeyStore | None = None,
    ledger: str | os.PathLike[str] | None = None,
    audit_log: str | os.PathLike[str] | None = None,
    s3: S3Options | None = None,
    progress: Progress | None = None,
) -> SignReport:
    """Sign the newest generation of ``store``, those of ``step``, or all of them
    (``every``), each only after verifying it completely (see the module docstring).

    ``run_id`` defaults to the one run the store's generations belong to (several:
    ``UsageError``). A generation signed by another key is refused unless
    ``replace_signatures`` and its signature verifies with one of ``trusted_keys``.
    ``progress(done, total)`` counts generations. The report's ``ok`` is False when a
    generation failed or was refused."""
    if step is not None and every:
        raise UsageError("step= and every=True are exclusive: give one, or neither (the newest)")
    if replace_signatures and not trusted_keys:
        raise UsageError(
            "replacing signatures needs trusted_keys=: a signature is replaced only once it "
            "verifies with a trusted key"
        )
    trust = TrustContext.configure(
        signing_key=signing_key,
        keystore=keystore,
        ledger=ledger,
        audit_log=audit_log,
        always_ledger=True,  # abandoned generations are never signed
        always_audit=True,
    )
    assert trust.signer is not None
    opened = open_store(store, must_exist=True, s3=s3)
    trust.check_outside(opened)
    replaceable = TrustedKeys.load(trusted_keys) if replace_signatures and trusted_keys else None
    with _writer_lock(opened):
        chosen = _chosen(opened, step, every)
        run = _the_run(opened, run_id, trust)
        signer = GenerationSigner(run, trust.signer, trust.keystore, replaceable)
        report = SignReport(opened.location, run, signer.key_id)
        _sign_each(signer, opened, chosen, trust, report, Meter(progress, len(chosen)))
    _record(trust, report)
    return report


def _sign_each(
    signer: GenerationSigner,
    store: Store,
    chosen: list[GenerationRef],
    trust: TrustContext,
    report: SignReport,
    meter: Meter,
) -> None:
    """Each generation in turn, into ``report``; held to its run and to what an allowed
    rollback abandoned (per the ledger), not to the floor's step (history is signed)."""
    floor = trust.floor(report.run_id)
    policy = TrustPolicy(run_id=report.run_id, floor=floor.without_step() if floor else None)
    try:
        for ref in chosen:
            report.generations.append(signer.sign(store, ref, policy))
            meter(1)
    except BaseException as exc:  # some may be signed already: that goes on record too
        with contextlib.suppress(AuditError):
            _record(trust, report, f"{type(exc).__name__}: {exc}")
        raise


def _chosen(store: Store, step: int | None, every: bool) -> list[GenerationRef]:
    """The newest generation, those of ``step``, or every one; none marked for deletion."""
    selection = CandidateSelector(store, None, TrustContext()).select(step, floor_applies=False)
    if not selection.candidates:
        raise UsageError(f"store {store.location} holds no generations")
    return selection.candidates if every or step is not None else selection.candidates[:1]


def _the_run(store: Store, run_id: str | None, trust: TrustContext) -> str:
    """The run whose generations are signed, and the refusals before anything is
    signed: several runs without ``run_id``, a run with encrypted generations without
    a key store.

    Every generation in the store is read, not only the chosen ones: without
    ``run_id``, a generation of another run planted at the chosen step would otherwise
    be taken for the run and signed with the operator's key; and a run that has
    encrypted generations is an encrypted run, whose plaintext generations (planted:
    restore refuses them) only its key store tells apart."""
    runs: set[str] = set()
    encrypted: list[GenerationRef] = []
    for ref in store.list_generations():
        try:
            manifest = check_structure(store, ref, TrustPolicy(run_id=run_id)).manifest
        except GenerationRejected:
            continue  # reported when it is verified for signing
        runs.add(manifest.run_id)
        if manifest.encryption is not None and trust.keystore is None:
            encrypted.append(ref)
    if run_id is None and len(runs) > 1:
        found = ", ".join(repr(run[:80]) for run in sorted(runs)[:5])
        raise UsageError(
            f"store {store.location} holds generations of runs {found}: pass run_id= to say "
            "whose to sign. Nothing was signed"
        )
    if encrypted:
        steps = ", ".join(str(ref.step) for ref in encrypted[:5])
        raise UsageError(
            f"generations of steps {steps}{', ...' if len(encrypted) > 5 else ''} are encrypted: "
            "pass keystore= with the run's key store, so that each manifest's MAC is checked "
            "before it is signed (and a plaintext generation planted in the run is not). "
            "Nothing was signed"
        )
    if run_id is None and not runs:
        raise UsageError(
            f"no generation chosen in {store.location} verifies, so its run is unknown: pass "
            "run_id=, or fix the store (ckptvault verify). Nothing was signed"
        )
    return run_id if run_id is not None else runs.pop()


@contextlib.contextmanager
def _writer_lock(store: Store) -> Iterator[None]:
    try:
        store.acquire_writer()
    except StoreLockedError as exc:
        raise StoreLockedError(
            f"{exc}. Signing adds signatures only while no trainer writes the store: run it "
            "between training jobs"
        ) from None
    try:
        yield
    finally:
        store.release_writer()


def _record(trust: TrustContext, report: SignReport, error: str | None = None) -> None:
    """One ``signed`` audit entry per call: the key, and every generation signed."""
    signed = [g for g in report.generations if g.outcome == SIGNED]
    fields: dict[str, Any] = {"error": error} if error is not None else {}
    trust.record(
        f"{len(signed)} generation(s) of run {report.run_id!r} were signed",
        "signed",
        run_id=report.run_id,
        store=report.store,
        key_id=report.key_id,
        generations=[
            {"step": g.step, "generation_id": g.generation_id}
            | ({"replaced_key_id": g.previous_key_id} if g.previous_key_id else {})
            for g in signed
        ],
        **{name.replace("-", "_"): n for name, n in report.counts().items()},
        **fields,
    )
