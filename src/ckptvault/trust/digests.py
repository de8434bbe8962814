"""BLAKE3 digests of whole files and of their fixed-size chunks.

Every file in a generation is recorded with its size, the BLAKE3 digest of each
``chunk_size`` slice (the last one may be shorter) and a whole-file digest. Chunk
digests let a reader verify exactly the part of a file it reads.

The whole-file digest is *derived* from the chunk digests (manifest format version
2 and later), so that every byte is hashed once::

    blake3(b"ckptvault file digest v2\0"
           + size.to_bytes(8, "little")
           + b"".join(bytes.fromhex(d) for d in chunk_digests)).hexdigest()

A file is checked with a few lines of Python and the ``blake3`` package: hash each
``chunk_size`` slice, compare each with the manifest's ``chunks``, then the derived
digest with its ``blake3``. Format version 1 recorded BLAKE3 over the file's bytes
(what ``b3sum`` prints); such generations still verify that way
(:func:`derives_file_digest`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from blake3 import blake3

from ckptvault.errors import IntegrityError
from ckptvault.format.records import FileRecord

DEFAULT_CHUNK_SIZE = 4 * 1024 * 1024
READ_BLOCK = DEFAULT_CHUNK_SIZE
HEAD_READ_BLOCK = 1024 * 1024  # verifying a header reads its first chunk in these


DERIVED_SINCE_FORMAT = 2
_DERIVED_DOMAIN = b"ckptvault file digest v2\0"


def derives_file_digest(format_version: int) -> bool:
    """Whether manifests of ``format_version`` record derived whole-file digests."""
    return format_version >= DERIVED_SINCE_FORMAT


def derived_file_digest(size: int, chunks: Sequence[str]) -> str:
    """The whole-file digest of a file of ``size`` bytes with these chunk digests
    (see the module docstring)."""
    hasher = blake3(_DERIVED_DOMAIN)
    hasher.update(size.to_bytes(8, "little"))
    for digest in chunks:
        hasher.update(bytes.fromhex(digest))
    return hasher.hexdigest()


class FileDigester:
    """Computes a :class:`FileRecord` from a file's bytes, fed in order.

    ``derived`` (the default, format version 2): the whole-file digest comes from the
    chunk digests, each byte hashed once; otherwise (format 1) a second hasher runs
    over every byte. ``whole_file=False``: no whole-file digest at all."""

    def __init__(
        self, chunk_size: int = DEFAULT_CHUNK_SIZE, whole_file: bool = True, derived: bool = True
    ) -> None:
        if chunk_size <= 0:
            raise ValueError("chunk_size must be positive")
        self.chunk_size = chunk_size
        self.size = 0
        self._derived = whole_file and derived
        self._whole = blake3() if whole_file and not derived else None
        self._chunk = blake3()
        self._chunk_fill = 0
        self._chunks: list[str] = []

    def update(self, data: bytes | bytearray | memoryview) -> None:
        view = memoryview(data).cast("B")
        if self._whole is not None:
            self._whole.update(view)
        self.size += len(view)
        position = 0
        while position < len(view):
            piece = view[position : position + self.chunk_size - self._chunk_fill]
            self._chunk.update(piece)
            self._chunk_fill += len(piece)
            position += len(piece)
            if self._chunk_fill == self.chunk_size:
                self._close_chunk()

    @property
    def chunk_digests(self) -> Sequence[str]:
        """Digests of the chunks closed so far, in order."""
        return self._chunks

    def close_partial_chunk(self) -> None:
        """Close a chunk shorter than ``chunk_size`` (the file's last) now."""
        if self._chunk_fill:
            self._close_chunk()

    def _close_chunk(self) -> None:
        self._chunks.append(self._chunk.hexdigest())
        self._chunk = blake3()
        self._chunk_fill = 0

    def finish(self) -> FileRecord:
        self.close_partial_chunk()
        if self._derived:
            whole = derived_file_digest(self.size, self._chunks)
        else:
            whole = self._whole.hexdigest() if self._whole is not None else ""
        return FileRecord(self.size, whole, tuple(self._chunks))


class ChunkVerifier:
    """Checks a file's bytes, fed in order, against its :class:`FileRecord`.

    Raises :class:`IntegrityError` at the first chunk whose digest differs, so a
    caller never uses bytes of a chunk that did not verify.
    """

    def __init__(
        self,
        record: FileRecord,
        chunk_size: int,
        where: str,
        whole_file: bool = True,
        derived: bool = True,
    ) -> None:
        self.record = record
        self.where = where
        self.whole_file = whole_file
        # derived: the whole-file digest is checked from the chunk digests (format 2).
        self._digester = FileDigester(chunk_size, whole_file, derived)
        self._checked = 0

    def update(self, data: bytes | bytearray | memoryview) -> None:
        if self._digester.size + len(memoryview(data).cast("B")) > self.record.size:
            raise IntegrityError(
                f"{self.where}: file is longer than the {self.record.size} bytes the manifest "
                "records"
            )
        self._digester.update(data)
        if self._digester.size == self.record.size:
            # The file's last, shorter chunk is complete: check it now, before any of
            # its bytes is used, not at finish().
            self._digester.close_partial_chunk()
        self._compare_closed_chunks()

    def _compare_closed_chunks(self) -> None:
        closed = self._digester.chunk_digests
        expected = self.record.chunks
        while self._checked < len(closed):
            index = self._checked
            if index >= len(expected) or closed[index] != expected[index]:
                start = index * self._digester.chunk_size
                raise IntegrityError(
                    f"{self.where}: bytes {start}..{start + self._digester.chunk_size} "
                    f"(chunk {index + 1} of {len(expected)}) do not match the manifest digest: "
                    "the file changed after it was written"
                )
            self._checked += 1

    def finish(self) -> None:
        if self._digester.size != self.record.size:
            raise IntegrityError(
                f"{self.where}: file has {self._digester.size} bytes, the manifest records "
                f"{self.record.size} (truncated or extended)"
            )
        record = self._digester.finish()
        self._compare_closed_chunks()
        if len(record.chunks) != len(self.record.chunks) or (
            self.whole_file and record.blake3 != self.record.blake3
        ):
            raise IntegrityError(
                f"{self.where}: whole-file BLAKE3 digest does not match the manifest"
            )


class ReadableInto(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...


def read_full(stream: ReadableInto, buffer: memoryview) -> int:
    """Fill ``buffer`` from ``stream``; returns the byte count (short only at EOF)."""
    filled = 0
    while filled < len(buffer):
        count = stream.readinto(buffer[filled:])
        if not count:
            break
        filled += count
    return filled


def read_verified_head(
    stream: ReadableInto,
    record: FileRecord,
    chunk_size: int,
    where: str,
    probe: int,
    length_of: Callable[[bytes], int],
) -> bytes:
    """A file's first ``length_of(first probe bytes)`` bytes, returned only once every
    chunk that holds them matched the manifest (``IntegrityError`` otherwise).

    For headers: their bytes are checked before any parser sees them. The probe bytes
    reach ``length_of`` unverified, so it may only use them to decide how much to
    read, and must bound that (it raises, typically ``FormatError``, when too much).
    Memory: the head itself plus one read block; the rest of the last chunk that
    holds the head is hashed and dropped.
    """
    verifier = ChunkVerifier(record, chunk_size, where, whole_file=False)
    buffer = memoryview(bytearray(max(probe, min(chunk_size, HEAD_READ_BLOCK))))
    head = bytearray()
    count = read_full(stream, buffer[:probe])
    length = length_of(bytes(buffer[:count]))
    verify_to = min(record.size, -(-length // chunk_size) * chunk_size)
    position = 0
    while True:
        if count:
            verifier.update(buffer[:count])  # raises before the bytes are kept
            if position < length:
                head += buffer[: min(count, length - position)]
            position += count
        if position >= verify_to:
            break
        count = read_full(stream, buffer[: min(len(buffer), verify_to - position)])
        if not count:
            raise IntegrityError(
                f"{where}: file ends at byte {position}, the manifest records {record.size}"
            )
    if len(head) < length:
        raise IntegrityError(f"{where}: file ends within its {length}-byte header")
    return bytes(head)


def verify_stream(
    stream: ReadableInto,
    record: FileRecord,
    chunk_size: int,
    where: str,
    on_bytes: Callable[[int], None] | None = None,
    derived: bool = True,
) -> None:
    """Read ``stream`` to its end and verify every chunk and the whole file (its
    digest derived from the chunks', or over its bytes for format version 1)."""
    verifier = ChunkVerifier(record, chunk_size, where, derived=derived)
    # No larger than the file is said to be (a zero-filled chunk per tiny file adds
    # up); at least one byte, so that bytes beyond the recorded size are still seen.
    buffer = memoryview(bytearray(max(1, min(chunk_size, record.size))))
    while True:
        count = read_full(stream, buffer)
        if count:
            verifier.update(buffer[:count])
            if on_bytes is not None:
                on_bytes(count)
        if count < len(buffer):
            break
    verifier.finish()
