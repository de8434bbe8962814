"""Before a key rotation changes anything: every generation of the stores, and the
refusals that must come before the first key moves.

The survey reads each manifest as stored, unverified: it only decides which
generations the rotation has to look at (:mod:`ckptvault.ops.rotation.steps`
verifies each one before re-wrapping it). A manifest that cannot be *read* (I/O) is
marked so and reported failed rather than skipped, which keeps the retired KEK: that
generation may well be under it, and destroying the KEK would strand it.
"""

from __future__ import annotations

from dataclasses import dataclass

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ckptvault.errors import CheckpointError, FormatError, UsageError
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME
from ckptvault.format.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from ckptvault.storage.base import GenerationRef, Store


@dataclass
class SurveyedGeneration:
    """One listed generation and what its (not yet verified) manifest says."""

    store: Store
    ref: GenerationRef
    manifest: Manifest | None = None
    manifest_bytes: bytes = b""  # as read, when it parsed
    signed: bool = False
    problem: str | None = None  # why its manifest could not be read or parsed
    unreadable: bool = False  # the problem is I/O, not content: never skip it silently


def survey(store: Store) -> list[SurveyedGeneration]:
    """Every generation of ``store`` and its manifest as stored (unverified)."""
    found = []
    for ref in store.list_generations():
        item = SurveyedGeneration(store, ref)
        try:
            entries = store.list_entries(ref)
            item.signed = SIGNATURE_NAME in entries
            manifest_entry = entries.get(MANIFEST_NAME)
            if manifest_entry is None or manifest_entry.size > MAX_MANIFEST_BYTES:
                raise FormatError("the manifest is missing or too large")
            data = store.read_bytes(ref, MANIFEST_NAME, manifest_entry.size)
            item.manifest = parse_manifest(data, f"{ref.location}")
            item.manifest_bytes = data
        except (FormatError, CheckpointError) as exc:
            item.problem = str(exc)
        except OSError as exc:
            item.problem, item.unreadable = f"cannot be read: {exc}", True
        found.append(item)
    return found


def refuse_signed_without_key(
    found: list[SurveyedGeneration], run_id: str, signer: Ed25519PrivateKey | None
) -> None:
    """UsageError, before any key moves, when generations of the run that rotation
    would re-wrap are signed and no signing key was given to sign them again."""
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
            "so it must sign them again: pass signing_key= (--signing-key) with the run's "
            "signing key. Nothing was changed"
        )
