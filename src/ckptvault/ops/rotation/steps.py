"""The steps of a key rotation for one generation: classify, verify, re-wrap,
re-sign, replace.

:meth:`GenerationRotator.classify` decides from the surveyed (unverified) manifest
whether a generation is this rotation's business at all; :meth:`GenerationRotator.rotate`
then verifies it completely before a byte of it changes — the restore checks, every
byte against its digests, the manifest's MAC, every data key unwrapping, and a
signature by the signing key or a trusted key — because re-wrapping and re-signing a
planted or damaged manifest would launder it. The loop over generations, and what
the outcomes decide, is :func:`ckptvault.ops.rotate.rotate_run_key`'s.
"""

from __future__ import annotations

from blake3 import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ckptvault.errors import (
    CheckpointError,
    KeyDestroyedError,
    KeyServiceError,
    SignatureError,
    UsageError,
)
from ckptvault.format.layout import SIGNATURE_NAME
from ckptvault.format.manifest import Manifest
from ckptvault.ops.rotation.journal import RotationJournal
from ckptvault.ops.rotation.report import ALREADY_ROTATED, FAILED, ROTATED
from ckptvault.ops.rotation.survey import SurveyedGeneration
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import (
    MAX_SIGNATURE_BYTES,
    CheckedGeneration,
    TrustPolicy,
    check_digests,
    check_structure,
)
from ckptvault.trust.keystore import RotatingKeyStore, RotationKeys
from ckptvault.trust.manifest_auth import authenticate_manifest
from ckptvault.trust.problems import GenerationRejected
from ckptvault.trust.rewrap import rewrap_manifest
from ckptvault.trust.signing import MANIFEST_DOMAIN, TrustedKeys, sign, verify

_UNCONFIRMED = (
    "rotation cannot confirm it is not this run's under the retired key (a manifest "
    "edited in the store looks like this): fix or delete it, or pass "
    "--abandon-unverified to destroy the retired key anyway"
)


class GenerationRotator:
    """Moves one generation at a time from the retired KEK(s) to the new one."""

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

    def classify(self, item: SurveyedGeneration) -> tuple[str | None, str]:
        """What to do with a generation before verifying it; None: re-wrap it.

        Only what the run's keys confirm counts as done: a generation already under
        the new KEK is ``ALREADY_ROTATED`` once its manifest's MAC checks with it. Any
        other manifest that does not say "this run, wrapped by the retired KEK" is
        ``FAILED``, never skipped: it may be a genuine generation whose manifest was
        edited or damaged in the store, and destroying the retired KEK would strand it
        for good once the manifest is put back. Such generations keep the retired KEK
        until they are fixed or deleted, or the operator passes ``--abandon-unverified``.
        """
        manifest = item.manifest
        if manifest is None:
            return FAILED, f"manifest {item.problem}; {_UNCONFIRMED}"
        if manifest.run_id != self.run_id:
            return FAILED, f"its manifest names run {manifest.run_id!r}; {_UNCONFIRMED}"
        if manifest.encryption is None:
            return FAILED, f"its manifest says it is not encrypted; {_UNCONFIRMED}"
        kek_id = manifest.encryption.kek_id
        if kek_id == self.keys.new_kek_id:
            return self._confirm_rotated(item, manifest)
        if kek_id not in self.keys.retired_kek_ids:
            return FAILED, f"its manifest names key {kek_id}, not this run's; {_UNCONFIRMED}"
        return None, ""

    def _confirm_rotated(
        self, item: SurveyedGeneration, manifest: Manifest
    ) -> tuple[str | None, str]:
        """ALREADY_ROTATED when the manifest's MAC checks with the new KEK; else FAILED."""
        where = f"generation {item.ref.generation_id} (step {item.ref.step})"
        try:
            authenticate_manifest(manifest, item.manifest_bytes, self.keystore, where)
        except (KeyDestroyedError, KeyServiceError):
            raise
        except (CheckpointError, ValueError, OSError) as exc:
            return FAILED, f"names the new key but does not authenticate with it: {exc}"
        return ALREADY_ROTATED, ""

    def rotate(self, item: SurveyedGeneration) -> tuple[str, str]:
        """Verify the generation, then replace its manifest by the re-wrapped (and
        re-signed) one: ``(ROTATED, "")``, or ``(FAILED, why)`` when it does not
        verify or cannot be written. KeyDestroyedError and KeyServiceError propagate:
        they are about the whole run or the service, not this generation."""
        store, ref = item.store, item.ref
        where = f"generation {ref.generation_id} (step {ref.step}) in {store.location}"
        try:
            checked, signed = self._verify(store, ref, where)
            old = checked.manifest_bytes
            new, signature = self._rewrapped(ref, checked, signed, where)
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

    def _verify(
        self, store: Store, ref: GenerationRef, where: str
    ) -> tuple[CheckedGeneration, bool]:
        """The generation, checked completely, and whether it is signed (by a key
        rotation trusts); raises GenerationRejected, SignatureError, ..."""
        checked = check_structure(store, ref, TrustPolicy(run_id=self.run_id))
        problems = check_digests(store, checked)
        if problems:
            raise GenerationRejected(ref, problems)
        authenticate_manifest(checked.manifest, checked.manifest_bytes, self.keystore, where)
        return checked, self._check_signature(store, ref, checked.manifest_bytes)

    def _rewrapped(
        self, ref: GenerationRef, checked: CheckedGeneration, signed: bool, where: str
    ) -> tuple[bytes, bytes | None]:
        """The new manifest (and its signature when the old one was signed), made once
        per generation and old manifest, whichever store holds it."""
        old = checked.manifest_bytes
        made_key = (ref.generation_id, blake3(old).hexdigest())
        if made_key not in self.made:
            new = rewrap_manifest(old, checked.manifest, self.keystore, self.keys.new_kek_id, where)
            signature = None
            if signed:
                assert self.signer is not None  # refused up front otherwise
                signature = sign(self.signer, new, MANIFEST_DOMAIN)
            self.made[made_key] = (new, signature)
        return self.made[made_key]

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
