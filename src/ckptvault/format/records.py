"""The typed sections of a manifest: what it promises about each file, and how the
files of an encrypted generation are keyed.

Parsing here is strict and bounded: every field is type-checked, every digest is 64
lowercase hex characters, every wrapped key decodes, every shape, offset and length
of the ``dcp`` section is a plain non-negative integer within int64. The manifest module assembles
these sections; readers (restore, export, ``verify``) use the parsed objects and
never the raw JSON.
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptvault.errors import FormatError
from ckptvault.format.container import MAX_SEGMENT_SIZE
from ckptvault.format.tensorfile import (
    DTYPES,
    MAX_TENSOR_BYTES,
    MAX_TENSOR_RANK,
    checked_shape,
)

_HEX64_RE = re.compile(r"^[0-9a-f]{64}\Z")
MAX_WRAPPED_KEY_CHARS = 4096
# The encryption section's manifest-authentication fields (see EncryptionSection).
WRAPPED_MAC_KEY = "wrapped_mac_key"
MANIFEST_MAC = "manifest_mac"


@dataclass(frozen=True)
class FileRecord:
    """What the manifest promises about one file: its size, the BLAKE3 digest of
    all its bytes, and the BLAKE3 digest of each ``chunk_size`` slice."""

    size: int
    blake3: str
    chunks: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {"size": self.size, "blake3": self.blake3, "chunks": list(self.chunks)}

    @classmethod
    def parse(cls, name: str, raw: Any, where: str) -> FileRecord:
        if not isinstance(raw, dict):
            raise FormatError(f"{where}: entry for file {name!r} is not an object")
        size, digest, chunks = raw.get("size"), raw.get("blake3"), raw.get("chunks")
        if (
            not isinstance(size, int)
            or isinstance(size, bool)
            or not 0 <= size <= MAX_TENSOR_BYTES  # no file is larger: keeps sums in int64
            or not isinstance(digest, str)
            or not _HEX64_RE.match(digest)
            or not isinstance(chunks, list)
            or not all(isinstance(c, str) and _HEX64_RE.match(c) for c in chunks)
        ):
            raise FormatError(f"{where}: entry for file {name!r} has an invalid size or digest")
        return cls(size=size, blake3=digest, chunks=tuple(chunks))


@dataclass(frozen=True)
class EncryptionSection:
    """How an encrypted generation's files are keyed: every file has its own data
    key, stored only wrapped by the run's key-encryption key ``kek_id``.

    ``wrapped_mac_key`` and ``manifest_mac`` authenticate the whole manifest for
    whoever holds the KEK (see :mod:`ckptvault.trust.manifest_auth`): a random key,
    stored only wrapped, and the keyed BLAKE3 of the manifest's authenticated bytes
    (:func:`ckptvault.format.manifest.authenticated_bytes`) as 64 hex digits. Both or
    neither: a section without them (written before manifests were authenticated,
    or stripped) parses, and restore refuses it (``manifest-unauthenticated``).
    """

    cipher: str
    kek_id: str
    segment_size: int
    wrapped_keys: Mapping[str, bytes]  # file name -> wrapped data key
    wrapped_mac_key: bytes | None = None  # the manifest MAC key, wrapped by the KEK
    manifest_mac: str | None = None  # keyed BLAKE3, hex; None only while sealing

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "cipher": self.cipher,
            "kek_id": self.kek_id,
            "segment_size": self.segment_size,
            "files": {
                name: {"wrapped_key": base64.b64encode(wrapped).decode("ascii")}
                for name, wrapped in sorted(self.wrapped_keys.items())
            },
        }
        if self.wrapped_mac_key is not None:
            document[WRAPPED_MAC_KEY] = base64.b64encode(self.wrapped_mac_key).decode("ascii")
        if self.manifest_mac is not None:
            document[MANIFEST_MAC] = self.manifest_mac
        return document

    @classmethod
    def parse(cls, raw: Any, files: Mapping[str, FileRecord], where: str) -> EncryptionSection:
        """Validate the ``encryption`` section: a wrapped key per listed file, never a
        plaintext key; the manifest MAC and its wrapped key both present or both
        absent."""
        where = f"{where} encryption"
        if not isinstance(raw, dict):
            raise FormatError(f"{where}: must be an object")
        cipher, kek_id = raw.get("cipher"), raw.get("kek_id")
        segment_size, entries = raw.get("segment_size"), raw.get("files")
        if not isinstance(cipher, str) or not isinstance(kek_id, str):
            raise FormatError(f"{where}: cipher and kek_id must be strings")
        if (
            not isinstance(segment_size, int)
            or isinstance(segment_size, bool)
            or not 0 < segment_size <= MAX_SEGMENT_SIZE
        ):
            raise FormatError(f"{where}: segment_size must be an integer in 1..{MAX_SEGMENT_SIZE}")
        if not isinstance(entries, dict):
            raise FormatError(f"{where}: files must be an object")
        wrapped_keys = {}
        for name, entry in entries.items():
            encoded = entry.get("wrapped_key") if isinstance(entry, dict) else None
            if name not in files or not isinstance(encoded, str):
                raise FormatError(f"{where}: entry for {name!r} is malformed")
            wrapped_keys[name] = _wrapped_key(encoded, f"wrapped key of {name!r}", where)
        wrapped_mac_key, manifest_mac = _manifest_authentication(raw, where)
        return cls(cipher, kek_id, segment_size, wrapped_keys, wrapped_mac_key, manifest_mac)


def _wrapped_key(encoded: str, what: str, where: str) -> bytes:
    if len(encoded) > MAX_WRAPPED_KEY_CHARS:
        raise FormatError(f"{where}: {what} is implausibly long")
    try:
        return base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise FormatError(f"{where}: {what} is not base64") from exc


def _manifest_authentication(raw: dict[str, Any], where: str) -> tuple[bytes | None, str | None]:
    """``(wrapped MAC key, MAC)``: both present and well formed, or both absent."""
    encoded, mac = raw.get(WRAPPED_MAC_KEY), raw.get(MANIFEST_MAC)
    if encoded is None and mac is None:
        return None, None
    if not isinstance(encoded, str) or not isinstance(mac, str) or not _HEX64_RE.match(mac):
        raise FormatError(
            f"{where}: {WRAPPED_MAC_KEY} (base64) and {MANIFEST_MAC} (64 lowercase hex digits) "
            "must be given together"
        )
    return _wrapped_key(encoded, WRAPPED_MAC_KEY, where), mac


def check_dcp_section(raw: Any, where: str) -> dict[str, Any]:
    """Type-check the ``dcp`` section (see ``ckptvault.io.dcp_metadata``) and return it.

    Every tensor has a dtype ckptvault writes and a bounded shape; every chunk has
    ``offsets`` and ``sizes`` (lists of non-negative ints), ``start`` and ``length``
    (non-negative ints) and string ``file`` and ``name``. Nothing downstream then
    meets a float, a bool, a negative or an astronomically large number. Whether the
    chunks tile their shapes and fit their files is checked against the files
    (``ckptvault.trust.chunk_layout``).
    """
    where = f"{where}: dcp metadata"
    tensors = raw.get("tensors") if isinstance(raw, dict) else None
    if not isinstance(tensors, dict):
        raise FormatError(f"{where} must be an object with a 'tensors' object")
    for fqn, info in tensors.items():
        at = f"{where}: tensor {fqn[:200]!r}"
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise FormatError(f"{at}: dtype {str(dtype)[:40]!r} is not one ckptvault writes")
        checked_shape(info.get("shape"), dtype, at)
        chunks = info.get("chunks")
        if not isinstance(chunks, list):
            raise FormatError(f"{at}: chunks must be a list")
        for chunk in chunks:
            if not (
                isinstance(chunk, dict)
                and isinstance(chunk.get("file"), str)
                and isinstance(chunk.get("name"), str)
                and _is_bounded(chunk.get("start"))
                and _is_bounded(chunk.get("length"))
                and _is_index(chunk.get("offsets"))
                and _is_index(chunk.get("sizes"))
            ):
                raise FormatError(
                    f"{at}: a chunk is malformed (offsets and sizes must be lists of "
                    "non-negative integers, start and length non-negative integers, file "
                    "and name strings)"
                )
    return raw


def _is_bounded(value: Any) -> bool:
    """A plain int (never bool) in 0..MAX_TENSOR_BYTES, as :func:`is_count` and bounded."""
    return type(value) is int and 0 <= value <= MAX_TENSOR_BYTES


def _is_index(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= MAX_TENSOR_RANK
        and all(type(item) is int and 0 <= item <= MAX_TENSOR_BYTES for item in value)
    )
