"""Load one generation, verified: the restore checks, then every byte hashed (and
decrypted) into private buffers, then the saved state decoded.

Used by ``CheckpointManager.restore`` and by the weights-only export, so both read
through exactly the same rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptvault.errors import (
    CheckpointError,
    DecryptionError,
    FormatError,
    IntegrityError,
    KeyDestroyedError,
    KeyUnavailableError,
    UnsafeEntryError,
)
from ckptvault.format.layout import is_encrypted_name
from ckptvault.format.manifest import Manifest
from ckptvault.io.dcp_io import read_tensors
from ckptvault.io.in_place import PendingInPlace, verify_first
from ckptvault.io.state_file import encrypted_state_reference, read_state_file
from ckptvault.state.capture import decode_tree
from ckptvault.state.ranks import tree_for_rank
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.timing import StageClock
from ckptvault.trust.authenticity import check_authenticity
from ckptvault.trust.checks import CheckedGeneration, IndexChoice, TrustPolicy, check_structure
from ckptvault.trust.envelope import binding
from ckptvault.trust.indexes import indexes_for_files
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.problems import (
    AUTHENTICATION_FAILED,
    DIGEST_MISMATCH,
    KEY_UNAVAILABLE,
    MANIFEST_INVALID,
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
    # Per-rank entries of a multi-rank save this rank cannot restore (the world size
    # changed; ``ckptvault.state.ranks``): they are left as they are.
    reset: list[str] = field(default_factory=list)
    # in_place=True: verified, its big tensors still to read (placeholders in ``saved``;
    # :mod:`ckptvault.io.in_place`).
    pending: PendingInPlace | None = None


def load_verified(
    store: Store,
    ref: GenerationRef,
    policy: TrustPolicy,
    keystore: KeyStore | None,
    threads: int,
    require_encryption: bool = False,
    rank: int = 0,
    world_size: int = 1,
    clock: StageClock | None = None,
    in_place: bool = False,
) -> LoadedGeneration:
    """Verify ``ref`` completely and decode it, as rank ``rank`` of ``world_size``
    sees it (the job's entries, and the rank's own when the world size is the one
    that saved it). ``clock`` counts the checks before any tensor byte under
    ``verification`` and reading, hashing and decoding the bytes under ``read``.
    ``in_place``: verify every byte but keep only the small tensors; the big ones are
    read later, into the live tensors where they fit (``LoadedGeneration.pending``).

    Raises :class:`GenerationRejected` for anything wrong with the generation (the
    caller tries the next one) and :class:`KeyDestroyedError` after crypto-erase.
    """
    clock = clock or StageClock()
    with clock.stage("verification"):
        prepared = prepare_load(store, ref, policy, keystore, require_encryption)
    manifest = prepared.checked.manifest
    with clock.stage("read"):
        pending = None
        try:
            if in_place:
                pending = verify_first(store, ref, manifest, threads, prepared.data_keys)
            if pending is not None:
                pending.tree = prepared.tree
                tensors = pending.tensors()
            else:
                keys = prepared.data_keys
                tensors = read_tensors(store, ref, manifest, threads, data_keys=keys)
        except (CheckpointError, OSError) as exc:
            raise rejection(ref, exc) from exc
        tree = prepared.tree
        saved, reset = decode_for_rank(ref, manifest, tree, tensors, rank, world_size)
    return LoadedGeneration(ref, manifest, saved, prepared.checked.signer, reset, pending)


@dataclass
class PreparedLoad:
    """A generation past every check that needs no tensor byte: structure, signature,
    authenticity, keys unwrapped, state tree read."""

    checked: CheckedGeneration
    data_keys: dict[str, bytes]
    tree: Any


def prepare_load(
    store: Store,
    ref: GenerationRef,
    policy: TrustPolicy,
    keystore: KeyStore | None,
    require_encryption: bool,
    indexes: IndexChoice | None = None,
) -> PreparedLoad:
    """The checks before any tensor byte is read; GenerationRejected when one fails.

    ``indexes`` picks which of a format-3 generation's indexes to load (default: all);
    the one covering an encrypted state file is always among them."""
    if indexes is not None:
        choice = indexes
        indexes = lambda manifest: {*choice(manifest), *state_file_indexes(manifest)}  # noqa: E731
    checked = check_structure(store, ref, policy, indexes)
    # Before any key, tensor or state byte is used.
    check_authenticity(checked, keystore, require_encryption)
    data_keys = unwrap_data_keys(ref, checked.manifest, keystore)
    try:
        tree = _state_tree(store, ref, checked.manifest, data_keys)
    except (CheckpointError, OSError) as exc:
        raise rejection(ref, exc) from exc
    return PreparedLoad(checked, data_keys, tree)


def state_file_indexes(manifest: Manifest) -> set[str]:
    """The index covering the file that holds the state (encrypted runs), if any."""
    try:
        name = encrypted_state_reference(manifest.state)
    except FormatError:
        return set()  # refused where the state is read
    return indexes_for_files(manifest, [name] if name in manifest.files else [])


def rejection(ref: GenerationRef, exc: CheckpointError | OSError) -> CheckpointError:
    """What a failure while reading a candidate's bytes means for the candidate:
    GenerationRejected with its reason code (other errors pass through)."""
    for kind, code in (
        (DecryptionError, AUTHENTICATION_FAILED),
        (UnsafeEntryError, UNSAFE_ENTRY),
        (IntegrityError, DIGEST_MISMATCH),
        (FormatError, TENSOR_FILE_INVALID),
        (OSError, UNREADABLE),
    ):
        if isinstance(exc, kind):
            return GenerationRejected(ref, [Problem(code, str(exc))])
    if isinstance(exc, CheckpointError):
        return exc
    raise AssertionError(exc)


def decode_for_rank(
    ref: GenerationRef,
    manifest: Manifest,
    tree: Any,
    tensors: dict[str, Any],
    rank: int,
    world_size: int,
) -> tuple[dict[str, Any], list[str]]:
    """The saved state rank ``rank`` of ``world_size`` restores, decoded, and the
    per-rank entries it cannot restore; GenerationRejected when it does not decode."""
    where = f"generation {ref.generation_id}"
    try:
        view, reset = tree_for_rank(tree, saved_world_size(manifest), rank, world_size, where)
        return decode_tree(view, tensors, where), reset
    except FormatError as exc:
        raise GenerationRejected(ref, [Problem(MANIFEST_INVALID, str(exc))]) from exc


def saved_world_size(manifest: Manifest) -> int:
    """How many ranks wrote ``manifest`` (1 when it does not say)."""
    size = manifest.writer.get("world_size", 1) if isinstance(manifest.writer, dict) else 1
    if type(size) is not int or not 1 <= size <= 1 << 20:
        raise FormatError(f"the manifest's writer.world_size {size!r} is not a rank count")
    return size


def _state_tree(
    store: Store, ref: GenerationRef, manifest: Manifest, data_keys: dict[str, bytes]
) -> dict[str, Any]:
    """The saved state's JSON tree: from the manifest, or decrypted from its file."""
    name = encrypted_state_reference(manifest.state)
    if name is None:
        return manifest.state
    if name not in data_keys or not is_encrypted_name(name):
        raise FormatError(f"the encrypted state file {name} has no wrapped key")
    return read_state_file(store, ref, manifest, name, data_keys[name])


def unwrap_data_keys(
    ref: GenerationRef,
    manifest: Manifest,
    keystore: KeyStore | None,
    have: dict[str, bytes] | None = None,
) -> dict[str, bytes]:
    """The file keys of an encrypted generation: ``have`` and those of the other files
    the manifest covers (a rank of many: the files of the indexes it loaded, so that
    it unwraps its own files' keys, not every rank's)."""
    keys = dict(have or {})
    if manifest.encryption is None:
        return keys
    if keystore is None:
        raise GenerationRejected(
            ref,
            [Problem(KEY_UNAVAILABLE, "the generation is encrypted; pass keystore= to read it")],
        )
    section = manifest.encryption
    for name, wrapped in section.wrapped_keys.items():
        if name in keys or not manifest.covers(name):
            continue
        try:
            context = binding(manifest.run_id, manifest.generation_id, name)
            keys[name] = keystore.unwrap(manifest.run_id, section.kek_id, wrapped, context)
        except KeyDestroyedError:
            raise
        except (KeyUnavailableError, ValueError) as exc:  # ValueError: a malformed wrapped key
            raise GenerationRejected(ref, [Problem(KEY_UNAVAILABLE, str(exc), name)]) from exc
    return keys
