"""Envelope encryption of one file: AES-256-GCM over fixed-size segments.

:class:`EncryptingWriter` turns a plaintext byte stream of known length into the
container format of :mod:`ckptvault.format.container`; :class:`SegmentDecryptor`
turns verified container bytes back into plaintext, segment by segment, calling
back with each piece and its plaintext offset. Each file has its own random data
key (the caller wraps it with the run's KEK); each segment has its own random
nonce and tag; the associated data binds (run id, generation id, file name,
segment index, final flag). Each generation also gets a random manifest MAC key,
wrapped the same way under its own context (:func:`manifest_key_binding`).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ckptvault.errors import DecryptionError, FormatError, IntegrityError
from ckptvault.format.container import (
    NONCE_BYTES,
    SEGMENT_OVERHEAD,
    TAG_BYTES,
    ContainerHeader,
    build_container_header,
    container_header_length,
    parse_container_header,
)

_SEGMENT_DOMAIN = b"ckptvault segment v1\0"
DATA_KEY_BYTES = 32
MANIFEST_KEY_PURPOSE = "ckptvault manifest mac key v1"


class ByteSink(Protocol):
    def write(self, data: bytes | bytearray | memoryview) -> int: ...


def _field(value: str) -> bytes:
    raw = value.encode("utf-8")
    return struct.pack("<I", len(raw)) + raw


def binding(run_id: str, generation_id: str, file_name: str) -> bytes:
    """What a file's ciphertext is bound to (also the key-wrapping context)."""
    return _field(run_id) + _field(generation_id) + _field(file_name)


def manifest_key_binding(run_id: str, generation_id: str) -> bytes:
    """The key-wrapping context of a generation's manifest MAC key.

    Four length-prefixed fields: run id, generation id, an empty file name and the
    purpose label. A file's context (:func:`binding`) has three, and a sequence of
    length-prefixed fields parses one way only, so this context equals no file's
    for any run id, generation id or file name: a wrapped MAC key never opens as a
    data key, nor a data key as the MAC key, nor either for another generation.
    """
    return binding(run_id, generation_id, "") + _field(MANIFEST_KEY_PURPOSE)


def segment_ad(context: bytes, index: int, final: bool) -> bytes:
    return _SEGMENT_DOMAIN + context + struct.pack("<QB", index, 1 if final else 0)


def new_data_key() -> bytes:
    return os.urandom(DATA_KEY_BYTES)


class EncryptingWriter:
    """Encrypt exactly ``plaintext_size`` bytes into ``sink`` as a container."""

    def __init__(
        self,
        sink: ByteSink,
        data_key: bytes,
        context: bytes,
        segment_size: int,
        plaintext_size: int,
        where: str = "encrypted file",
    ) -> None:
        self.sink = sink
        self.where = where
        self.header = build_container_header(segment_size, plaintext_size)
        self._aead = AESGCM(data_key)
        self._context = context
        self._buffer = bytearray(segment_size)
        self._fill = 0
        self._index = 0
        self._written = 0
        self._sealed = bytearray(segment_size + TAG_BYTES)
        sink.write(self.header.header_bytes)

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        if self._written + len(view) > self.header.plaintext_size:
            raise FormatError(
                f"{self.where}: more plaintext than the container header announced (the state "
                "changed while it was being saved)"
            )
        position = 0
        segment = len(self._buffer)
        while position < len(view):
            if (
                self._fill == 0
                and len(view) - position >= segment
                and self._written + segment < self.header.plaintext_size
            ):
                # A whole, non-final segment straight from the caller's memory: no copy.
                self._seal(view[position : position + segment], final=False)
                position += segment
                self._written += segment
                continue
            room = segment - self._fill
            piece = view[position : position + room]
            self._buffer[self._fill : self._fill + len(piece)] = piece
            self._fill += len(piece)
            position += len(piece)
            self._written += len(piece)
            if self._fill == segment and self._written < self.header.plaintext_size:
                self._seal(memoryview(self._buffer), final=False)
        return len(view)

    def _seal(self, plain: memoryview, final: bool) -> None:
        nonce = os.urandom(NONCE_BYTES)
        out = memoryview(self._sealed)[: len(plain) + TAG_BYTES]
        self._aead.encrypt_into(nonce, plain, segment_ad(self._context, self._index, final), out)
        self.sink.write(nonce)
        self.sink.write(out)
        self._index += 1
        if plain.obj is self._buffer:
            self._fill = 0

    def close(self) -> None:
        if self._written != self.header.plaintext_size:
            raise FormatError(
                f"{self.where}: container got {self._written} plaintext bytes, announced "
                f"{self.header.plaintext_size} (the state changed while it was being saved)"
            )
        self._seal(memoryview(self._buffer)[: self._fill], final=True)


class SegmentDecryptor:
    """Feed verified container bytes in order; plaintext comes out through ``emit``.

    ``emit(offset, data)`` receives each segment's plaintext and its offset in the
    plaintext; ``data`` is only valid during the call.
    """

    def __init__(
        self, data_key: bytes, context: bytes, where: str, emit: Callable[[int, memoryview], None]
    ) -> None:
        self._aead = AESGCM(data_key)
        self._context = context
        self._where = where
        self._emit = emit
        self._pending = bytearray()
        self.header: ContainerHeader | None = None
        self._index = 0
        self._plain_offset = 0
        self._plain = bytearray()

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        self._pending += data
        if self.header is None:
            if len(self._pending) < 12:
                return
            total = container_header_length(bytes(self._pending[:12]), self._where)
            if len(self._pending) < total:
                return
            self.header = parse_container_header(bytes(self._pending[:total]), None, self._where)
            del self._pending[:total]
            # One segment of plaintext at most, and never more than the file holds.
            header = self.header
            self._plain = bytearray(max(1, min(header.segment_size, header.plaintext_size)))
        header = self.header
        while self._index < header.segments:
            plain_size = header.segment_plaintext(self._index)
            record = plain_size + SEGMENT_OVERHEAD
            if len(self._pending) < record:
                return
            self._open(memoryview(self._pending)[:record], plain_size)
            del self._pending[:record]

    def _open(self, record: memoryview, plain_size: int) -> None:
        assert self.header is not None
        final = self._index == self.header.segments - 1
        nonce, sealed = record[:NONCE_BYTES], record[NONCE_BYTES:]
        out = memoryview(self._plain)[:plain_size]
        try:
            self._aead.decrypt_into(
                bytes(nonce), sealed, segment_ad(self._context, self._index, final), out
            )
        except InvalidTag:
            raise DecryptionError(
                f"{self._where}: encrypted segment {self._index + 1} of {self.header.segments} "
                "failed authentication (edited, reordered, truncated, or moved from another "
                "file, generation or run)"
            ) from None
        self._emit(self._plain_offset, out)
        self._plain_offset += plain_size
        self._index += 1

    def finish(self) -> None:
        if self.header is None or self._index != self.header.segments or self._pending:
            raise IntegrityError(
                f"{self._where}: encrypted container is incomplete or has trailing bytes"
            )


class FileEncryption:
    """Per-save encryption settings: a fresh data key per file, wrapped by the run's KEK."""

    def __init__(
        self, keystore: KeyStoreLike, run_id: str, generation_id: str, segment_size: int
    ) -> None:
        self.keystore = keystore
        self.run_id = run_id
        self.generation_id = generation_id
        self.segment_size = segment_size

    def context(self, file_name: str) -> bytes:
        return binding(self.run_id, self.generation_id, file_name)

    def new_file_key(self, file_name: str) -> tuple[bytes, str, bytes]:
        """``(data key, KEK id, wrapped data key)`` for one file."""
        data_key = new_data_key()
        kek_id, wrapped = self.keystore.wrap(self.run_id, data_key, self.context(file_name))
        return data_key, kek_id, wrapped

    def new_manifest_key(self) -> tuple[bytes, str, bytes]:
        """``(MAC key, KEK id, wrapped MAC key)`` for this generation's manifest."""
        mac_key = new_data_key()
        context = manifest_key_binding(self.run_id, self.generation_id)
        kek_id, wrapped = self.keystore.wrap(self.run_id, mac_key, context)
        return mac_key, kek_id, wrapped


class KeyStoreLike(Protocol):
    def wrap(self, run_id: str, data_key: bytes, context: bytes) -> tuple[str, bytes]: ...
