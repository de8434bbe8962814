"""Re-wrapping one encrypted manifest under its run's new KEK (key rotation).

Rotation changes which KEK wraps a generation's keys and nothing else: every
wrapped data key and the wrapped manifest MAC key move from the retired KEK to the
new one under the same context (:meth:`RotatingKeyStore.rewrap
<ckptvault.trust.keystore.RotatingKeyStore.rewrap>`), ``kek_id`` names the new KEK,
the MAC is recomputed with the same MAC key, and the self-digest last. The data
keys, and so every data file, stay exactly as they are.

The manifest is edited as the JSON document it was stored as, not rebuilt from the
parsed :class:`~ckptvault.format.manifest.Manifest`, so every other key at every
level keeps its exact value. Before the new bytes are handed back they are checked
as a reader would: they parse, their MAC verifies under the new KEK, every data key
unwraps to the key it was before, and nothing outside the encryption section
changed. Whatever fails raises; nothing has been written by then.
"""

from __future__ import annotations

import base64
from typing import Any

from blake3 import blake3

from ckptvault.errors import IntegrityError, KeyUnavailableError
from ckptvault.format.canonical import dumps_canonical, loads_canonical
from ckptvault.format.manifest import (
    MAX_MANIFEST_BYTES,
    MAX_MANIFEST_DEPTH,
    SELF_DIGEST_KEY,
    Manifest,
    authenticated_bytes,
    parse_manifest,
)
from ckptvault.format.records import MANIFEST_MAC, WRAPPED_MAC_KEY
from ckptvault.trust.envelope import binding, manifest_key_binding
from ckptvault.trust.keystore import RotatingKeyStore
from ckptvault.trust.manifest_auth import authenticate_manifest, manifest_mac


def rewrap_manifest(
    manifest_bytes: bytes,
    manifest: Manifest,
    keystore: RotatingKeyStore,
    new_kek_id: str,
    where: str,
) -> bytes:
    """The bytes of ``manifest`` (parsed from, and authenticated as, ``manifest_bytes``)
    with every key re-wrapped under ``new_kek_id`` and its MAC and self-digest
    recomputed (see the module docstring)."""
    section = manifest.encryption
    if section is None or section.wrapped_mac_key is None:
        raise ValueError("only an authenticated encrypted manifest can be re-wrapped")
    run_id, generation_id = manifest.run_id, manifest.generation_id
    document: dict[str, Any] = loads_canonical(
        manifest_bytes, where, max_depth=MAX_MANIFEST_DEPTH, max_bytes=MAX_MANIFEST_BYTES
    )
    document.pop(SELF_DIGEST_KEY, None)
    encryption = document["encryption"]
    data_keys = {}
    for name, wrapped in sorted(section.wrapped_keys.items()):
        context = binding(run_id, generation_id, name)
        data_keys[name] = keystore.unwrap(run_id, section.kek_id, wrapped, context)
        kek_id, rewrapped = keystore.rewrap(run_id, section.kek_id, wrapped, context)
        _expect_kek(kek_id, new_kek_id, where)
        encryption["files"][name]["wrapped_key"] = _b64(rewrapped)
    context = manifest_key_binding(run_id, generation_id)
    kek_id, wrapped_mac_key = keystore.rewrap(
        run_id, section.kek_id, section.wrapped_mac_key, context
    )
    _expect_kek(kek_id, new_kek_id, where)
    mac_key = keystore.unwrap(run_id, new_kek_id, wrapped_mac_key, context)
    encryption["kek_id"] = new_kek_id
    encryption[WRAPPED_MAC_KEY] = _b64(wrapped_mac_key)
    encryption.pop(MANIFEST_MAC, None)
    encryption[MANIFEST_MAC] = manifest_mac(mac_key, authenticated_bytes(document))
    document[SELF_DIGEST_KEY] = blake3(dumps_canonical(document)).hexdigest()
    rewritten = dumps_canonical(document)
    _check_rewrapped(manifest, rewritten, keystore, data_keys, where)
    return rewritten


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _expect_kek(kek_id: str, new_kek_id: str, where: str) -> None:
    if kek_id != new_kek_id:
        raise KeyUnavailableError(
            f"{where}: the key store re-wrapped under {kek_id}, not the rotation's new key "
            f"{new_kek_id} (another rotation of this run started meanwhile?); nothing was "
            "written. Run the rotation again"
        )


def _check_rewrapped(
    old: Manifest,
    rewritten: bytes,
    keystore: RotatingKeyStore,
    data_keys: dict[str, bytes],
    where: str,
) -> None:
    """Read the new bytes back as restore would; IntegrityError when anything but
    the key wrapping differs (a bug: nothing is written then)."""
    new = parse_manifest(rewritten, where)
    authenticate_manifest(new, rewritten, keystore, where)
    assert new.encryption is not None and old.encryption is not None
    unchanged = {key: value for key, value in old.to_json().items() if key != "encryption"}
    same = unchanged == {k: v for k, v in new.to_json().items() if k != "encryption"} and (
        (old.encryption.cipher, old.encryption.segment_size, set(old.encryption.wrapped_keys))
        == (new.encryption.cipher, new.encryption.segment_size, set(new.encryption.wrapped_keys))
    )
    for name, data_key in data_keys.items():
        context = binding(new.run_id, new.generation_id, name)
        wrapped = new.encryption.wrapped_keys[name]
        same = same and keystore.unwrap(new.run_id, new.encryption.kek_id, wrapped, context) == (
            data_key
        )
    if not same:
        raise IntegrityError(
            f"{where}: the re-wrapped manifest does not describe the same generation (this is "
            "a bug in ckptvault, please report it); nothing was written"
        )
