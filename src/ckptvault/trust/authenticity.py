"""What a generation must satisfy beyond its structure before anything trusts it.

The structure checks (:mod:`ckptvault.trust.checks`) need no key: they prove that a
generation is complete and consistent, not who wrote it. Unsigned, anyone who can
write the store can recompute every digest. In an encrypted run the manifest's MAC
(:mod:`ckptvault.trust.manifest_auth`) is what proves the run's key holder wrote it,
and every file must be encrypted (a planted plaintext generation is not the run's).

Restore applies this rule before it reads a tensor byte, and so must everything else
that decides about a generation (DESIGN rule 7): retention and gc before a generation
takes a rule's place, replication before a copy counts in another tier, export.
:func:`check_authenticity` is that one rule; :func:`~ckptvault.trust.checks.check_trusted`
applies it after the structure checks when the reader's policy asks for it.
"""

from __future__ import annotations

from typing import Protocol

from ckptvault.errors import FormatError, KeyDestroyedError, KeyUnavailableError
from ckptvault.format.layout import MANIFEST_NAME, encrypted_state_reference, is_encrypted_name
from ckptvault.format.manifest import Manifest
from ckptvault.storage.base import GenerationRef
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.manifest_auth import ManifestAuthenticationError, authenticate_manifest
from ckptvault.trust.problems import (
    KEY_UNAVAILABLE,
    MANIFEST_INVALID,
    MANIFEST_UNAUTHENTICATED,
    NOT_ENCRYPTED,
    GenerationRejected,
    Problem,
)


class Checked(Protocol):
    """What this rule reads of a structurally checked generation
    (:class:`~ckptvault.trust.checks.CheckedGeneration`; checks imports this module)."""

    @property
    def ref(self) -> GenerationRef: ...

    @property
    def manifest(self) -> Manifest: ...

    @property
    def manifest_bytes(self) -> bytes: ...


def check_authenticity(
    checked: Checked, keystore: KeyStore | None, require_encryption: bool
) -> None:
    """In an encrypted run (``require_encryption``) every file encrypted, and an
    encrypted manifest's MAC made with its run's key, over exactly the bytes that were
    parsed. An encrypted generation read without a key store is ``key-unavailable``:
    nothing vouches for it.

    Raises :class:`GenerationRejected`, and :class:`KeyDestroyedError` after
    crypto-erase.
    """
    if require_encryption:
        _require_all_encrypted(checked.ref, checked.manifest)
    _authenticate(checked, keystore)


def _require_all_encrypted(ref: GenerationRef, manifest: Manifest) -> None:
    """An encrypted run never writes plaintext: every data file is an encrypted
    container with a wrapped key, and the state is in the encrypted state file. A
    generation that is not was planted, or written before encryption was turned on.
    Nor does it write an unauthenticated manifest: an encrypted generation without a
    manifest MAC is refused by :func:`_authenticate` (``manifest-unauthenticated``),
    which runs for every encrypted generation, in an encrypted run or not."""
    wrapped = manifest.encryption.wrapped_keys if manifest.encryption else {}
    plain = sorted(n for n in manifest.files if not (is_encrypted_name(n) and n in wrapped))
    try:
        state_file = encrypted_state_reference(manifest.state)
    except FormatError:
        state_file = None
    if plain or state_file is None:
        what = f"files {', '.join(plain)} are" if plain else "its state is"
        raise GenerationRejected(
            ref, [Problem(NOT_ENCRYPTED, f"{what} not encrypted, but this run encrypts")]
        )


def _authenticate(checked: Checked, keystore: KeyStore | None) -> None:
    """An encrypted manifest must carry a MAC made with its run's key, over exactly
    the bytes that were parsed (see :mod:`ckptvault.trust.manifest_auth`)."""
    ref, manifest = checked.ref, checked.manifest
    if manifest.encryption is None:
        return
    if keystore is None:
        raise GenerationRejected(
            ref,
            [Problem(KEY_UNAVAILABLE, "the generation is encrypted; pass keystore= to read it")],
        )
    where = f"generation {ref.generation_id} (step {ref.step})"
    try:
        authenticate_manifest(manifest, checked.manifest_bytes, keystore, where)
    except KeyDestroyedError:
        raise
    except ManifestAuthenticationError as exc:
        problem = Problem(MANIFEST_UNAUTHENTICATED, str(exc), MANIFEST_NAME)
        raise GenerationRejected(ref, [problem]) from exc
    except (KeyUnavailableError, ValueError) as exc:  # ValueError: a malformed wrapped key
        problem = Problem(KEY_UNAVAILABLE, f"the manifest MAC key: {exc}", MANIFEST_NAME)
        raise GenerationRejected(ref, [problem]) from exc
    except FormatError as exc:  # the bytes parsed once already; a second parse agrees
        raise GenerationRejected(ref, [Problem(MANIFEST_INVALID, str(exc))]) from exc
