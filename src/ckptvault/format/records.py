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
    is_count,
)

_HEX64_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_WRAPPED_KEY_CHARS = 4096


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
            or size < 0
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
    key, stored only wrapped by the run's key-encryption key ``kek_id``."""

    cipher: str
    kek_id: str
    segment_size: int
    wrapped_keys: Mapping[str, bytes]  # file name -> wrapped data key

    def to_json(self) -> dict[str, Any]:
        return {
            "cipher": self.cipher,
            "kek_id": self.kek_id,
            "segment_size": self.segment_size,
            "files": {
                name: {"wrapped_key": base64.b64encode(wrapped).decode("ascii")}
                for name, wrapped in sorted(self.wrapped_keys.items())
            },
        }

    @classmethod
    def parse(cls, raw: Any, files: Mapping[str, FileRecord], where: str) -> EncryptionSection:
        """Validate the ``encryption`` section: a wrapped key per listed file, never a
        plaintext key."""
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
            if len(encoded) > MAX_WRAPPED_KEY_CHARS:
                raise FormatError(f"{where}: wrapped key of {name!r} is implausibly long")
            try:
                wrapped_keys[name] = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise FormatError(f"{where}: wrapped key of {name!r} is not base64") from exc
        return cls(cipher, kek_id, segment_size, wrapped_keys)


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
                and all(_is_bounded(chunk.get(key)) for key in ("start", "length"))
                and all(_is_index(chunk.get(key)) for key in ("offsets", "sizes"))
            ):
                raise FormatError(
                    f"{at}: a chunk is malformed (offsets and sizes must be lists of "
                    "non-negative integers, start and length non-negative integers, file "
                    "and name strings)"
                )
    return raw


def _is_bounded(value: Any) -> bool:
    return is_count(value) and value <= MAX_TENSOR_BYTES


def _is_index(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) <= MAX_TENSOR_RANK
        and all(_is_bounded(item) for item in value)
    )
