"""The encrypted container: a segmented AES-256-GCM file format (parsed without keys).

Layout::

    b"CKVENC\\x00\\x01"               8-byte magic
    header length                    4 bytes, little-endian
    header                           canonical JSON: format, cipher, segment_size,
                                     plaintext_size
    segment 0 .. segment K-1         each: 12-byte nonce, ciphertext, 16-byte tag

Every segment but the last holds ``segment_size`` plaintext bytes; an empty
plaintext still has one (empty) final segment. Each segment's associated data binds
the run id, generation id, file name, segment index and a final-segment flag (see
``ckptvault.trust.envelope``), so segments cannot be reordered, dropped, truncated
or moved between files, generations or runs without failing authentication. The
file's total size follows from the header, so this module can check it — and
anyone can verify the manifest digests of encrypted files — without the key.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import TypeGuard

from ckptvault.errors import FormatError
from ckptvault.format.bounded_json import MAX_HEADER_DEPTH
from ckptvault.format.canonical import dumps_canonical, loads_canonical

MAGIC = b"CKVENC\x00\x01"
CONTAINER_FORMAT = "ckptvault-container/1"
CIPHER = "AES-256-GCM"
NONCE_BYTES = 12
TAG_BYTES = 16
SEGMENT_OVERHEAD = NONCE_BYTES + TAG_BYTES
DEFAULT_SEGMENT_SIZE = 1024 * 1024
_PREFIX = len(MAGIC) + 4
CONTAINER_PREFIX_BYTES = _PREFIX  # what container_header_length needs to see
MAX_HEADER = 64 * 1024
MAX_SEGMENT_SIZE = 64 * 1024 * 1024  # a reader buffers one segment per file
MAX_PLAINTEXT = 1 << 62


@dataclass(frozen=True)
class ContainerHeader:
    segment_size: int
    plaintext_size: int
    header_bytes: bytes  # magic, length and JSON: everything before segment 0

    @property
    def segments(self) -> int:
        return max(1, -(-self.plaintext_size // self.segment_size))

    def segment_plaintext(self, index: int) -> int:
        if index < self.segments - 1:
            return self.segment_size
        return self.plaintext_size - self.segment_size * (self.segments - 1)

    @property
    def stored_size(self) -> int:
        return len(self.header_bytes) + self.plaintext_size + self.segments * SEGMENT_OVERHEAD


def build_container_header(segment_size: int, plaintext_size: int) -> ContainerHeader:
    body = dumps_canonical(
        {
            "format": CONTAINER_FORMAT,
            "cipher": CIPHER,
            "segment_size": segment_size,
            "plaintext_size": plaintext_size,
        }
    )
    return ContainerHeader(
        segment_size, plaintext_size, MAGIC + struct.pack("<I", len(body)) + body
    )


def container_header_length(prefix: bytes, where: str) -> int:
    """Total header size from the first 12 bytes of a container."""
    if len(prefix) < _PREFIX or prefix[: len(MAGIC)] != MAGIC:
        raise FormatError(f"{where} is not a ckptvault encrypted container")
    (length,) = struct.unpack("<I", prefix[len(MAGIC) : _PREFIX])
    if length > MAX_HEADER:
        raise FormatError(f"{where}: container header is implausibly large ({length} bytes)")
    return _PREFIX + length


def _is_size(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_container_header(header: bytes, file_size: int | None, where: str) -> ContainerHeader:
    total = container_header_length(header, where)
    if len(header) < total:
        raise FormatError(f"{where}: container header truncated")
    raw = loads_canonical(
        header[_PREFIX:total],
        f"{where} container header",
        max_depth=MAX_HEADER_DEPTH,
        max_bytes=MAX_HEADER,
    )
    if not isinstance(raw, dict):
        raise FormatError(f"{where}: container header is not a JSON object")
    if raw.get("format") != CONTAINER_FORMAT or raw.get("cipher") != CIPHER:
        found = f"{raw.get('format')!r}/{raw.get('cipher')!r}"[:120]
        raise FormatError(f"{where}: unsupported container {found}")
    segment_size, plaintext_size = raw.get("segment_size"), raw.get("plaintext_size")
    if not _is_size(segment_size) or not _is_size(plaintext_size):
        raise FormatError(f"{where}: container header sizes must be non-negative integers")
    if not 0 < segment_size <= MAX_SEGMENT_SIZE or plaintext_size > MAX_PLAINTEXT:
        raise FormatError(f"{where}: container header has invalid sizes")
    parsed = ContainerHeader(segment_size, plaintext_size, bytes(header[:total]))
    if file_size is not None and parsed.stored_size != file_size:
        raise FormatError(
            f"{where}: container should be {parsed.stored_size} bytes for {plaintext_size} bytes "
            f"of plaintext, but is {file_size} (segments dropped or added)"
        )
    return parsed
