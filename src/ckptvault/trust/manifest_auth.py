"""Manifest authentication for encrypted generations: a MAC only the KEK holder can make.

Unsigned, a manifest protects itself only with its BLAKE3 self-digest, which anyone
can recompute; and the AES-GCM envelope binds each file's segments to (run id,
generation id, file name), not to what the manifest says about them: the step, which
bytes hold which tensor, the contract. So whoever could write the store could relabel
an old generation as step 10**11 (raising the rollback floor past every genuine
generation) or swap two tensors' chunk records, and an encrypted run restored it.

Encrypted generations therefore carry a MAC over their whole manifest. The writer
draws a random 32-byte key per generation, wraps it with the run's KEK through the
:class:`~ckptvault.trust.keystore.KeyStore` protocol under its own context
(:func:`~ckptvault.trust.envelope.manifest_key_binding`: run id, generation id and a
purpose label, never a file's context), stores the wrapped key in the encryption
section, and stores beside it the keyed BLAKE3 of the domain label followed by the
manifest's authenticated bytes (:func:`~ckptvault.format.manifest.authenticated_bytes`:
its canonical JSON without the self-digest and without the MAC). The self-digest is
computed last, over everything, as for any manifest.

A reader unwraps the key (the KEK authenticates it) and compares MACs in constant
time before it reads or uses a byte of tensor or state. Without the KEK nobody can
compute a MAC for an edited manifest or transplant one: a MAC key wrapped for another
generation does not unwrap (``key-unavailable``), and another generation's MAC does
not match these bytes (``manifest-unauthenticated``). Against someone who can only
write the store, an encrypted run is then as tamper-evident as a signed one.
"""

from __future__ import annotations

import hmac
from dataclasses import replace

from blake3 import blake3

from ckptvault.errors import IntegrityError, KeyUnavailableError
from ckptvault.format.manifest import Manifest, stored_authenticated_bytes
from ckptvault.trust.envelope import DATA_KEY_BYTES, manifest_key_binding
from ckptvault.trust.keystore import KeyStore

_MAC_DOMAIN = b"ckptvault manifest mac v1\0"


class ManifestAuthenticationError(IntegrityError):
    """An encrypted manifest has no MAC, or its MAC does not match its bytes."""


def manifest_mac(key: bytes, authenticated: bytes) -> str:
    """Keyed BLAKE3 of the domain label and ``authenticated``, as 64 hex digits."""
    hasher = blake3(key=key)
    hasher.update(_MAC_DOMAIN)
    hasher.update(authenticated)
    return hasher.hexdigest()


def seal_manifest(manifest: Manifest, mac_key: bytes) -> Manifest:
    """``manifest`` with its MAC set. Its encryption section must already hold the
    wrapped MAC key: the MAC covers it like every other field."""
    section = manifest.encryption
    if section is None or section.wrapped_mac_key is None:
        raise ValueError("only an encrypted manifest with a wrapped MAC key can be sealed")
    unsealed = replace(manifest, encryption=replace(section, manifest_mac=None))
    mac = manifest_mac(mac_key, unsealed.authenticated_bytes())
    return replace(manifest, encryption=replace(section, manifest_mac=mac))


def authenticate_manifest(
    manifest: Manifest, manifest_bytes: bytes, keystore: KeyStore, where: str
) -> None:
    """Check the MAC of the encrypted manifest parsed from ``manifest_bytes``.

    Raises :class:`ManifestAuthenticationError` when it has none or it does not
    match, :class:`KeyUnavailableError` (or ``ValueError`` for a malformed wrapped
    key) when the MAC key does not unwrap with the run's KEK, and
    :class:`~ckptvault.errors.KeyDestroyedError` after crypto-erase.
    """
    section = manifest.encryption
    if section is None:
        raise ValueError("only an encrypted manifest carries a MAC")
    if section.wrapped_mac_key is None or section.manifest_mac is None:
        raise ManifestAuthenticationError(
            f"{where}: the manifest of this encrypted generation carries no MAC, so nothing "
            "proves it was written by the holder of the run's key (it was stripped, or "
            "written by a ckptvault release before manifests were authenticated)"
        )
    context = manifest_key_binding(manifest.run_id, manifest.generation_id)
    mac_key = keystore.unwrap(manifest.run_id, section.kek_id, section.wrapped_mac_key, context)
    if len(mac_key) != DATA_KEY_BYTES:
        raise KeyUnavailableError(f"{where}: the manifest MAC key is not a 256-bit key")
    expected = manifest_mac(mac_key, stored_authenticated_bytes(manifest_bytes, where, manifest))
    if not hmac.compare_digest(expected, section.manifest_mac):
        raise ManifestAuthenticationError(
            f"{where}: the manifest's MAC does not match its contents: it was edited after "
            "it was written (step, tensor records, file list or another field), or its MAC "
            "was copied from another generation"
        )
