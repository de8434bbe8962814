"""Signing one published generation: verify it completely, then add ``manifest.sig``.

:meth:`GenerationSigner.sign` is the whole of what ``ckptvault sign`` does to one
generation. A signature vouches for everything the manifest says, so nothing is
signed before it is verified as restore would: the structure checks, every byte of
every file against its digests, and for an encrypted generation the manifest's MAC
under the run's key. Then the generation's signature status decides:

- unsigned: signed;
- signed by the signing key, and the signature verifies: already signed, nothing to do;
- signed by the signing key, and it does not verify: failed (the manifest was edited
  after signing, or the signature is forged);
- signed by another key: refused, unless replacing was asked for and that signature
  verifies with a trusted key (a signature nobody can check is never laundered).

The signature covers the manifest's exact bytes, which do not change: the store writes
it with :meth:`~ckptvault.storage.base.Store.replace_manifest`, a compare-and-swap on
the bytes verified (signature first, then the same manifest bytes again), so a
manifest swapped in the meantime is never signed.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ckptvault.errors import CheckpointError, KeyDestroyedError, KeyServiceError, SignatureError
from ckptvault.format.layout import SIGNATURE_NAME
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.authenticity import check_authenticity
from ckptvault.trust.checks import (
    MAX_SIGNATURE_BYTES,
    CheckedGeneration,
    TrustPolicy,
    check_digests,
    check_structure,
)
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.problems import ROLLBACK, RUN_MISMATCH, GenerationRejected
from ckptvault.trust.signing import (
    MANIFEST_DOMAIN,
    TrustedKeys,
    key_id,
    parse_signature,
    sign,
    verify,
)

SIGNED = "signed"
ALREADY_SIGNED = "already-signed"
SKIPPED = "skipped"  # not this run's, or abandoned by a rollback: not ours to sign
REFUSED = "refused"  # signed by another key, and replacing it was not asked for
FAILED = "failed"  # does not verify, or could not be written
OUTCOMES = (SIGNED, ALREADY_SIGNED, SKIPPED, REFUSED, FAILED)


@dataclass(frozen=True)
class SignOutcome:
    step: int
    generation_id: str
    path: str
    outcome: str  # one of OUTCOMES
    detail: str = ""
    previous_key_id: str | None = None  # the signature replaced, if one was


class GenerationSigner:
    """Verifies and signs the generations of one run, one at a time."""

    def __init__(
        self,
        run_id: str,
        signer: Ed25519PrivateKey,
        keystore: KeyStore | None,
        replaceable: TrustedKeys | None,
    ) -> None:
        self.run_id = run_id
        self.signer = signer
        self.key_id = key_id(signer.public_key())
        self.own = TrustedKeys({self.key_id: signer.public_key()})
        self.keystore = keystore
        self.replaceable = replaceable  # whose signatures may be replaced; None: nobody's

    def sign(self, store: Store, ref: GenerationRef, policy: TrustPolicy) -> SignOutcome:
        """Verify ``ref`` under ``policy`` (its run, no floor step), then sign it."""

        def outcome(kind: str, detail: str = "", previous: str | None = None) -> SignOutcome:
            return SignOutcome(ref.step, ref.generation_id, ref.location, kind, detail, previous)

        try:
            checked = self._verified(store, ref, policy)
            previous = self._signed_by(store, ref, checked)
            if previous == self.key_id:
                return outcome(ALREADY_SIGNED)
            if previous is not None and self.replaceable is None:
                return outcome(
                    REFUSED,
                    f"already signed by key {previous}; to sign it with {self.key_id} instead, "
                    "pass --replace-signature with the key that signed it as --trusted-key",
                )
            signature = sign(self.signer, checked.manifest_bytes, MANIFEST_DOMAIN)
            store.replace_manifest(
                ref, checked.manifest_bytes, signature, replaces=checked.manifest_bytes
            )
        except (KeyDestroyedError, KeyServiceError):
            raise  # about the whole run or the key service, not this generation
        except GenerationRejected as exc:
            not_ours = _not_ours(exc)
            if not_ours is not None:
                return outcome(SKIPPED, f"{not_ours}: {exc.reason}")
            return outcome(FAILED, f"does not verify: {exc.reason}")
        except (CheckpointError, ValueError, OSError) as exc:
            return outcome(FAILED, f"{type(exc).__name__}: {exc}")
        replaced = f"replaced the signature by {previous}" if previous else ""
        return outcome(SIGNED, replaced, previous)

    def _verified(self, store: Store, ref: GenerationRef, policy: TrustPolicy) -> CheckedGeneration:
        """The generation checked as restore checks it, every byte hashed, and what
        restore requires in an encrypted run (a key store given): every file encrypted
        and the manifest's MAC made with the run's key; GenerationRejected or an
        integrity error otherwise."""
        checked = check_structure(store, ref, policy)
        problems = check_digests(store, checked)
        if problems:
            raise GenerationRejected(ref, problems)
        check_authenticity(checked, self.keystore, require_encryption=self.keystore is not None)
        return checked

    def _signed_by(
        self, store: Store, ref: GenerationRef, checked: CheckedGeneration
    ) -> str | None:
        """None when unsigned; else the key id of a signature that verifies: the
        signing key's own, or (when replacing) a trusted key's. SignatureError for a
        signature that does not verify."""
        if checked.signer is None:
            return None
        document = store.read_bytes(ref, SIGNATURE_NAME, MAX_SIGNATURE_BYTES)
        claimed, _ = parse_signature(document, SIGNATURE_NAME)
        if claimed == self.key_id:
            try:
                return verify(
                    document, checked.manifest_bytes, self.own, MANIFEST_DOMAIN, SIGNATURE_NAME
                )
            except SignatureError as exc:
                raise SignatureError(
                    f"{exc}: its manifest.sig names the signing key but does not match the "
                    "manifest (edited after signing, or forged); it is not signed again"
                ) from exc
        if self.replaceable is None:
            return claimed  # refused by the caller: never replaced without a check
        try:
            return verify(
                document, checked.manifest_bytes, self.replaceable, MANIFEST_DOMAIN, SIGNATURE_NAME
            )
        except SignatureError as exc:
            raise SignatureError(
                f"{exc}; a signature is replaced only when it verifies with a --trusted-key"
            ) from exc


def _not_ours(rejected: GenerationRejected) -> str | None:
    """Why a generation is not this signing's business (another run's, or abandoned by
    an allowed rollback), when that is all that is wrong with it; else None."""
    if rejected.codes == {RUN_MISMATCH}:
        return "another run's generation, not signed"
    if rejected.codes == {ROLLBACK}:
        return "abandoned by an allowed rollback (per the ledger), not signed"
    return None
