"""Load one generation, verified: the restore checks, then every byte hashed (and
decrypted) into private buffers, then the saved state decoded.

Used by ``CheckpointManager.restore`` and by the weights-only export, so both read
through exactly the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptvault.errors import (
    DecryptionError,
    FormatError,
    IntegrityError,
    KeyDestroyedError,
    KeyUnavailableError,
    UnsafeEntryError,
)
from ckptvault.format.manifest import Manifest
from ckptvault.io.dcp_io import read_tensors
from ckptvault.state.capture import decode_tree
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import TrustPolicy, check_structure
from ckptvault.trust.envelope import binding
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.problems import (
    AUTHENTICATION_FAILED,
    DIGEST_MISMATCH,
    KEY_UNAVAILABLE,
    MANIFEST_INVALID,
    NOT_ENCRYPTED,
    TENSOR_FILE_INVALID,
    UNREADABLE,
    UNSAFE_ENTRY,
    GenerationRejected,
    Problem,
)


@dataclass
class LoadedGeneration:
    ref: GenerationRef
    manifest: Manifest
    saved: dict[str, Any]  # the decoded state, with placeholders for live objects
    signer: str | None


def load_verified(
    store: Store,
    ref: GenerationRef,
    policy: TrustPolicy,
    keystore: KeyStore | None,
    threads: int,
    require_encryption: bool = False,
) -> LoadedGeneration:
    """Verify ``ref`` completely and decode it.

    Raises :class:`GenerationRejected` for anything wrong with the generation (the
    caller tries the next one) and :class:`KeyDestroyedError` after crypto-erase.
    """
    checked = check_structure(store, ref, policy)
    manifest = checked.manifest
    if require_encryption and manifest.encryption is None:
        # An encrypted run never writes plaintext: a plaintext generation was planted,
        # or written before encryption was turned on.
        raise GenerationRejected(
            ref, [Problem(NOT_ENCRYPTED, "the generation is not encrypted, but this run encrypts")]
        )
    data_keys = _data_keys(ref, manifest, keystore)
    try:
        tensors = read_tensors(store, ref, manifest, threads, data_keys=data_keys)
    except DecryptionError as exc:
        raise GenerationRejected(ref, [Problem(AUTHENTICATION_FAILED, str(exc))]) from exc
    except UnsafeEntryError as exc:
        raise GenerationRejected(ref, [Problem(UNSAFE_ENTRY, str(exc))]) from exc
    except IntegrityError as exc:
        raise GenerationRejected(ref, [Problem(DIGEST_MISMATCH, str(exc))]) from exc
    except FormatError as exc:
        raise GenerationRejected(ref, [Problem(TENSOR_FILE_INVALID, str(exc))]) from exc
    except OSError as exc:
        raise GenerationRejected(ref, [Problem(UNREADABLE, str(exc))]) from exc
    try:
        saved = decode_tree(manifest.state, tensors, f"generation {ref.generation_id}")
    except FormatError as exc:
        raise GenerationRejected(ref, [Problem(MANIFEST_INVALID, str(exc))]) from exc
    return LoadedGeneration(ref, manifest, saved, checked.signer)


def _data_keys(
    ref: GenerationRef, manifest: Manifest, keystore: KeyStore | None
) -> dict[str, bytes]:
    """Unwrap every file key of an encrypted generation."""
    if manifest.encryption is None:
        return {}
    if keystore is None:
        raise GenerationRejected(
            ref,
            [Problem(KEY_UNAVAILABLE, "the generation is encrypted; pass keystore= to read it")],
        )
    section = manifest.encryption
    keys = {}
    for name, wrapped in section.wrapped_keys.items():
        try:
            context = binding(manifest.run_id, manifest.generation_id, name)
            keys[name] = keystore.unwrap(manifest.run_id, section.kek_id, wrapped, context)
        except KeyDestroyedError:
            raise
        except KeyUnavailableError as exc:
            raise GenerationRejected(ref, [Problem(KEY_UNAVAILABLE, str(exc), name)]) from exc
    return keys
