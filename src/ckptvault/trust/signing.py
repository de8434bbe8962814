"""Ed25519 signatures over a manifest's exact bytes.

The signature lives beside the manifest as ``manifest.sig``, a small canonical JSON
document naming the algorithm and the signing key's id. Signatures are asymmetric:
trainers hold the private key, every verifier holds only public keys, so a machine
that can verify a checkpoint cannot forge one.

What is signed is a domain-separated message, ``b"ckptvault manifest v1\\0"`` followed
by the manifest bytes, so a signature made for anything else (an export manifest,
say) never verifies as a checkpoint signature.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from blake3 import blake3
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from ckptvault.errors import FormatError, SignatureError, UsageError
from ckptvault.format.canonical import dumps_canonical, loads_canonical

SIGNATURE_FORMAT = "ckptvault-signature/1"
MANIFEST_DOMAIN = b"ckptvault manifest v1\0"
EXPORT_DOMAIN = b"ckptvault export v1\0"

PrivateKeyLike = Ed25519PrivateKey | str | os.PathLike | bytes
PublicKeyLike = Ed25519PublicKey | Ed25519PrivateKey | str | os.PathLike | bytes


class UntrustedKeyError(SignatureError):
    """The signature was made by a key that is not among the trusted keys."""


def key_id(public_key: Ed25519PublicKey) -> str:
    """A short, stable name for a public key: ``ed25519:<32 hex>``."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return "ed25519:" + blake3(raw).hexdigest()[:32]


def generate_keypair(private_path: Path, public_path: Path) -> str:
    """Write a new private key (PEM, mode 0600) and its public key; return the key id."""
    private_key = Ed25519PrivateKey.generate()
    private_pem = private_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    public_pem = private_key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    for path in (private_path, public_path):
        if path.exists():
            raise UsageError(f"{path} already exists; refusing to overwrite a key")
    private_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(private_pem)
    public_path.parent.mkdir(parents=True, exist_ok=True)
    public_path.write_bytes(public_pem)
    return key_id(private_key.public_key())


def _read_pem(source: str | os.PathLike[str] | bytes, what: str) -> bytes:
    if isinstance(source, bytes):
        return source
    path = Path(source)
    try:
        return path.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from exc


def load_private_key(source: PrivateKeyLike) -> Ed25519PrivateKey:
    if isinstance(source, Ed25519PrivateKey):
        return source
    pem = _read_pem(source, "signing key")
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"signing key {source!r} is not an unencrypted PEM private key") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise UsageError(f"signing key {source!r} is not an Ed25519 key")
    return key


def load_public_key(source: PublicKeyLike) -> Ed25519PublicKey:
    if isinstance(source, Ed25519PublicKey):
        return source
    if isinstance(source, Ed25519PrivateKey):
        return source.public_key()
    pem = _read_pem(source, "trusted key")
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"trusted key {source!r} is not a PEM public key") from exc
    if not isinstance(key, Ed25519PublicKey):
        raise UsageError(f"trusted key {source!r} is not an Ed25519 key")
    return key


@dataclass(frozen=True)
class TrustedKeys:
    """The public keys a verifier accepts, by key id."""

    keys: dict[str, Ed25519PublicKey]

    @classmethod
    def load(cls, sources: Iterable[PublicKeyLike]) -> TrustedKeys:
        keys = {}
        for source in sources:
            public = load_public_key(source)
            keys[key_id(public)] = public
        if not keys:
            raise UsageError("trusted_keys is empty; give at least one public key")
        return cls(keys)


def sign(private_key: Ed25519PrivateKey, message: bytes, domain: bytes) -> bytes:
    """A detached signature document (canonical JSON bytes) over ``message``."""
    signature = private_key.sign(domain + message)
    return dumps_canonical(
        {
            "format": SIGNATURE_FORMAT,
            "algorithm": "ed25519",
            "key_id": key_id(private_key.public_key()),
            "signature": base64.b64encode(signature).decode("ascii"),
        }
    )


def parse_signature(document: bytes, where: str) -> tuple[str, bytes]:
    """``(key id, raw signature)`` from a signature document; FormatError if malformed."""
    raw = loads_canonical(document, where)
    if (
        not isinstance(raw, dict)
        or raw.get("format") != SIGNATURE_FORMAT
        or raw.get("algorithm") != "ed25519"
    ):
        raise FormatError(f"{where} is not a ckptvault Ed25519 signature")
    try:
        encoded = raw["signature"]
        signature = base64.b64decode(encoded, validate=True)
        signer = str(raw["key_id"])
    except (KeyError, ValueError, TypeError) as exc:
        raise FormatError(f"{where} is malformed ({exc})") from exc
    # One spelling per signature, as for the canonical JSON around it: base64 leaves
    # the low bits of the last character unused, and the decoder ignores them, so a
    # flipped bit there would otherwise verify as the untouched signature.
    if base64.b64encode(signature).decode("ascii") != encoded:
        raise FormatError(
            f"{where}: the signature is not in canonical base64 (it was edited or "
            "corrupted after signing); re-sign the manifest or restore a good copy"
        )
    return signer, signature


def verify(document: bytes, message: bytes, trusted: TrustedKeys, domain: bytes, where: str) -> str:
    """Check a signature document over ``message``; returns the signer's key id.

    Raises :class:`SignatureError` when the signature is malformed, made by a key
    that is not trusted, or does not match the message.
    """
    try:
        signer, signature = parse_signature(document, where)
    except FormatError as exc:
        raise SignatureError(str(exc)) from exc
    public = trusted.keys.get(signer)
    if public is None:
        raise UntrustedKeyError(
            f"{where}: signed by key {signer}, which is not among the trusted keys "
            f"({', '.join(sorted(trusted.keys))})"
        )
    try:
        public.verify(signature, domain + message)
    except InvalidSignature:
        raise SignatureError(
            f"{where}: the signature by {signer} does not match the signed bytes (they were "
            "edited after signing)"
        ) from None
    return signer
