"""Verified random access to a generation's stored bytes: any byte range of any
tensor file, each digest chunk that holds it checked before any of its bytes is
copied anywhere, encrypted files decrypted segment by segment (AES-GCM authenticates
each) with their tensor header tied to the manifest.

Two readers use it: consolidation and export (:mod:`ckptvault.ops.consolidate`,
whole tensors one at a time, memory about the largest tensor) and a multi-rank
restore (:mod:`ckptvault.io.ranged_reader`: each rank reads only the byte ranges of
the chunks its shards need, rounded out to digest chunks; a digest chunk another rank
read and sent it comes from a :class:`BlockSource` and is checked here alike). The generation must have
passed the restore checks first (:func:`ckptvault.io.load.prepare_load`): the
manifest then ties every chunk to bytes its files hold.
"""

from __future__ import annotations

import errno
import math
from collections import OrderedDict
from typing import Any, Protocol

import torch
from blake3 import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ckptvault.errors import CheckpointError, DecryptionError, FormatError, IntegrityError
from ckptvault.format.container import (
    CONTAINER_PREFIX_BYTES,
    NONCE_BYTES,
    SEGMENT_OVERHEAD,
    ContainerHeader,
    container_header_length,
    parse_container_header,
)
from ckptvault.format.manifest import Manifest
from ckptvault.format.tensorfile import (
    HEADER_LENGTH_BYTES,
    header_length,
    header_size_limit,
    parse_header,
)
from ckptvault.io.dcp_io import require_whole
from ckptvault.io.dcp_metadata import dtype_from_name
from ckptvault.io.load import rejection
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.chunk_layout import check_chunk_locations
from ckptvault.trust.envelope import binding, segment_ad

CACHED_FILES = 4  # files whose last verified block is kept


class BlockSource(Protocol):
    """Where a digest chunk's stored bytes come from when not from the store itself
    (a multi-rank restore: the one rank that read a shared chunk sends it to the
    others, :mod:`ckptvault.distributed.read_once`)."""

    def fetch(self, name: str, index: int, length: int) -> tuple[bytes, str] | None:
        """Chunk ``index`` of file ``name`` (``length`` bytes) and where it came from
        (for errors: "" for this process's own store read), or None: read it from
        the store. The bytes are checked against the chunk digest like the store's."""


class VerifiedRanges:
    """Whole tensors of one generation that passed the restore checks, read one at
    a time. Every stored byte is matched against its chunk digest before it is
    copied anywhere; encrypted files are decrypted segment by segment (AES-GCM
    authenticates each) and their tensor header is tied to the manifest, as restore
    does. Holds one digest chunk and one segment besides the tensor it reads.
    Read failures raise :class:`GenerationRejected` (the caller tries the next one).
    """

    def __init__(
        self,
        store: Store,
        ref: GenerationRef,
        manifest: Manifest,
        data_keys: dict[str, bytes],
        source: BlockSource | None = None,
    ) -> None:
        self.store, self.ref, self.manifest, self.data_keys = store, ref, manifest, data_keys
        self.source = source
        self._encrypted = set(manifest.encryption.wrapped_keys) if manifest.encryption else set()
        self.entries: dict[str, Any] = manifest.dcp["tensors"]
        # The last verified block of a few files: tensors read in turn from several
        # rank files (a row-sharded model) must not re-read and re-hash a block per
        # tensor. Bounded, because a manifest's author chooses the chunk size.
        self._blocks: OrderedDict[str, tuple[int, memoryview]] = OrderedDict()
        self._segment: tuple[str, int, bytes] | None = None
        self._containers: dict[str, ContainerHeader] = {}

    def read(self, key: str) -> torch.Tensor:
        """The full tensor ``key``, in a fresh buffer the caller owns."""
        try:
            return self._assemble(key)
        except (CheckpointError, OSError) as exc:
            raise rejection(self.ref, exc) from exc

    def _assemble(self, key: str) -> torch.Tensor:
        require_whole(self.manifest, f"generation {self.ref.generation_id}")
        info = self.entries[key]
        dtype = dtype_from_name(info["dtype"], f"{self.ref.location}: tensor {key[:200]!r}")
        try:
            full = torch.empty(tuple(info["shape"]), dtype=dtype)
        except (RuntimeError, MemoryError) as exc:  # the allocator's own error, untyped
            raise OSError(
                errno.ENOMEM,
                f"cannot allocate tensor {key[:200]!r} ({exc}); this needs memory for its "
                "largest tensor: run it on a machine with more",
            ) from exc
        for chunk in info["chunks"]:  # they tile the shape exactly (the restore checks)
            if not math.prod(chunk["sizes"]):
                continue
            region = full
            for dim, (offset, size) in enumerate(
                zip(chunk["offsets"], chunk["sizes"], strict=True)
            ):
                region = region.narrow(dim, offset, size)
            read_into = (
                self._read_plaintext if self._is_encrypted(chunk["file"]) else self._read_stored
            )
            if region.is_contiguous():  # whole tensors, row shards: straight into place
                read_into(chunk["file"], chunk["start"], bytes_of(region))
            else:
                staging = torch.empty(chunk["length"], dtype=torch.uint8)
                read_into(chunk["file"], chunk["start"], staging.numpy().data)
                region.copy_(staging.view(dtype).reshape(chunk["sizes"]))
        return full

    def read_range(self, name: str, start: int, out: memoryview) -> None:
        """Bytes ``start..start+len(out)`` of tensor file ``name`` as the tensor file
        holds them (decrypted when it is encrypted), verified, into ``out``."""
        if self._is_encrypted(name):
            self._read_plaintext(name, start, out)
        else:
            self._read_stored(name, start, out)

    def _is_encrypted(self, name: str) -> bool:
        """Whether ``name`` is an encrypted container: its key must have been unwrapped
        (a rank of many unwraps only its indexes' files' keys)."""
        if name not in self._encrypted:
            return False
        if name not in self.data_keys:
            raise FormatError(f"{self.ref.location}/{name}: its data key was not unwrapped")
        return True

    def _read_stored(self, name: str, start: int, out: memoryview) -> None:
        """Stored bytes ``start..start+len(out)`` of file ``name``, each digest chunk
        that holds them verified before any of its bytes is copied."""
        size = self.manifest.chunk_size
        position, end = start, start + len(out)
        while position < end:
            index = position // size
            block = self._verified_block(name, index)
            upto = min(end, index * size + len(block))
            if upto <= position:
                raise IntegrityError(f"{self.ref.location}/{name}: ends before byte {end}")
            lo = position - index * size
            out[position - start : upto - start] = block[lo : lo + upto - position]
            position = upto

    def _verified_block(self, name: str, index: int) -> memoryview:
        cached = self._blocks.get(name)
        if cached is not None and cached[0] == index:
            self._blocks.move_to_end(name)
            return cached[1]
        self._blocks.pop(name, None)
        record, size = self.manifest.files[name], self.manifest.chunk_size
        where = f"{self.ref.location}/{name}"
        length = min(size, record.size - index * size)
        if index >= len(record.chunks) or length <= 0:
            raise IntegrityError(f"{where}: byte {index * size} lies beyond the recorded size")
        fetched = self.source.fetch(name, index, length) if self.source is not None else None
        data, origin = fetched or (self.store.read_range(self.ref, name, index * size, length), "")
        # Bytes another rank sent are checked here exactly like the store's: the digest
        # comes from the manifest this rank verified itself, never from the sender.
        if len(data) != length or blake3(data).hexdigest() != record.chunks[index]:
            cause = (
                f"sent by {origin}, do not match the manifest digest: that rank's copy of "
                "the file, or the rank itself, is bad"
                if origin
                else "do not match the manifest digest: the file changed after it was written"
            )
            raise IntegrityError(
                f"{where}: bytes {index * size}..{index * size + length} (chunk {index + 1} of "
                f"{len(record.chunks)}) {cause}; nothing of it was used"
            )
        self._blocks[name] = (index, memoryview(data))
        while len(self._blocks) > CACHED_FILES:
            self._blocks.popitem(last=False)
        return self._blocks[name][1]

    def _container(self, name: str) -> ContainerHeader:
        header = self._containers.get(name)
        if header is None:
            where = f"{self.ref.location}/{name}"
            prefix = bytearray(CONTAINER_PREFIX_BYTES)
            self._read_stored(name, 0, memoryview(prefix))
            raw = bytearray(container_header_length(bytes(prefix), where))
            self._read_stored(name, 0, memoryview(raw))
            header = parse_container_header(bytes(raw), self.manifest.files[name].size, where)
            self._containers[name] = header
            self._check_plain_header(name, header.plaintext_size)
        return header

    def _read_plaintext(self, name: str, start: int, out: memoryview) -> None:
        """Plaintext bytes of encrypted file ``name``, segment by segment."""
        header = self._container(name)
        end = start + len(out)
        if end > header.plaintext_size:
            raise FormatError(f"{self.ref.location}/{name}: ends before plaintext byte {end}")
        step = header.segment_size
        for index in range(start // step, (end - 1) // step + 1 if end > start else 0):
            plain = self._open_segment(name, header, index)
            lo, hi = max(start, index * step), min(end, index * step + len(plain))
            out[lo - start : hi - start] = plain[lo - index * step : hi - index * step]

    def _open_segment(self, name: str, header: ContainerHeader, index: int) -> bytes:
        if self._segment is not None and self._segment[:2] == (name, index):
            return self._segment[2]
        sealed = bytearray(header.segment_plaintext(index) + SEGMENT_OVERHEAD)
        offset = len(header.header_bytes) + index * (header.segment_size + SEGMENT_OVERHEAD)
        self._read_stored(name, offset, memoryview(sealed))
        context = binding(self.manifest.run_id, self.manifest.generation_id, name)
        final = index == header.segments - 1
        try:
            plain = AESGCM(self.data_keys[name]).decrypt(
                bytes(sealed[:NONCE_BYTES]),
                bytes(sealed[NONCE_BYTES:]),
                segment_ad(context, index, final),
            )
        except InvalidTag:
            raise DecryptionError(
                f"{self.ref.location}/{name}: encrypted segment {index + 1} of {header.segments} "
                "failed authentication (edited, or moved from another file, generation or run)"
            ) from None
        self._segment = (name, index, plain)
        return plain

    def _check_plain_header(self, name: str, plaintext_size: int) -> None:
        """A decrypted tensor file's header must place every chunk where the manifest
        says (restore's reader checks the same)."""
        held = [chunk["name"] for _fqn, chunk in self.manifest.chunks_by_file.get(name, ())]
        limit = header_size_limit(held)
        prefix = bytearray(min(HEADER_LENGTH_BYTES, plaintext_size))
        self._read_plaintext(name, 0, memoryview(prefix))
        raw = bytearray(header_length(bytes(prefix), plaintext_size, name, limit))
        self._read_plaintext(name, 0, memoryview(raw))
        parsed = parse_header(bytes(raw), plaintext_size, name, limit)
        problems = check_chunk_locations(self.manifest, {name: parsed})
        if problems:
            raise FormatError("; ".join(str(p) for p in problems))


def bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's own memory, as bytes (writable)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data
