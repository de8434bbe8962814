"""The signed manifest of a weights-only export: written beside the exported file,
and checked by ``ckptvault verify-export`` (:func:`verify_export`) against the
file's size and BLAKE3 and a trusted key."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blake3 import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from ckptvault.durable import write_atomically
from ckptvault.errors import FormatError, IntegrityError
from ckptvault.format.canonical import dumps_canonical, loads_canonical
from ckptvault.format.layout import utc_now
from ckptvault.trust.signing import EXPORT_DOMAIN, PublicKeyLike, TrustedKeys, sign, verify

EXPORT_FORMAT = "ckptvault-export/1"


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote (:func:`ckptvault.ops.export.export_weights`) and from where."""

    path: Path
    tensors: int
    bytes: int
    blake3: str
    run_id: str
    step: int
    generation_id: str
    manifest_path: Path | None


def export_manifest_paths(out: Path) -> tuple[Path, Path]:
    """Where the export manifest and its signature live, beside the output."""
    return out.with_name(out.name + ".manifest.json"), out.with_name(out.name + ".manifest.sig")


def write_export_manifest(
    signer: Ed25519PrivateKey, result: ExportResult, key: str, dtype: str | None
) -> Path:
    """Write the signed export manifest beside the output; returns its path."""
    manifest_path, signature_path = export_manifest_paths(result.path)
    document = dumps_canonical(
        {
            "format": EXPORT_FORMAT,
            "file": result.path.name,
            "size": result.bytes,
            "blake3": result.blake3,
            "entry": key,
            "dtype": dtype,
            "tensors": result.tensors,
            "source": {
                "run_id": result.run_id,
                "step": result.step,
                "generation_id": result.generation_id,
            },
            "created_at": utc_now(),
        }
    )
    write_atomically(signature_path, sign(signer, document, EXPORT_DOMAIN))
    write_atomically(manifest_path, document)
    return manifest_path


@dataclass(frozen=True)
class ExportVerification:
    signer: str
    source: dict[str, Any]
    blake3: str


def verify_export(
    file: str | os.PathLike[str], trusted_keys: Iterable[PublicKeyLike]
) -> ExportVerification:
    """Check an export's signed manifest and that the file matches it.

    Raises SignatureError (untrusted or edited manifest), IntegrityError (the file
    differs from what was signed) or FormatError (no or malformed manifest)."""
    path = Path(file)
    manifest_path, signature_path = export_manifest_paths(path)
    try:
        document = manifest_path.read_bytes()
        signature = signature_path.read_bytes()
    except FileNotFoundError as exc:
        raise FormatError(
            f"{path} has no signed export manifest ({exc.filename} is missing); export it with --signing-key"
        ) from exc
    signer = verify(
        signature, document, TrustedKeys.load(trusted_keys), EXPORT_DOMAIN, str(signature_path)
    )
    raw = loads_canonical(document, str(manifest_path))
    if raw.get("format") != EXPORT_FORMAT or raw.get("file") != path.name:
        raise FormatError(f"{manifest_path} does not describe {path.name}")
    digest, size = _digest(path)
    if size != raw["size"] or digest != raw["blake3"]:
        raise IntegrityError(
            f"{path} does not match its signed export manifest (size or BLAKE3 differs)"
        )
    return ExportVerification(signer, raw["source"], digest)


def _digest(path: Path) -> tuple[str, int]:
    """BLAKE3 and size of a file."""
    hasher = blake3()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            hasher.update(chunk)
            size += len(chunk)
    return hasher.hexdigest(), size
