"""Consolidation with bounded memory: a generation's tensors streamed one at a time
into safetensors files (``ckptvault export`` and ``consolidate``, whose operations
are in :mod:`ckptvault.ops.export`).

A multi-rank generation keeps each tensor as chunks spread over the ranks' files
(the manifest's ``dcp`` section). For each tensor this allocates one full-size
buffer, fills it from every chunk that covers it, writes it out and frees it: the
memory held is about the largest tensor, whatever the model's size or rank count.

Nothing unverified reaches the output: the generation passes the restore checks
first (:func:`ckptvault.io.load.prepare_load`), then every stored byte is matched
against its chunk digest before it is copied anywhere (encrypted files are also
authenticated segment by segment). On a failure the temporary outputs are removed;
outputs are renamed into place once durable (:mod:`ckptvault.durable`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from blake3 import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ckptvault.durable import atomic_path, write_atomically
from ckptvault.errors import (
    CheckpointError,
    DecryptionError,
    FormatError,
    IntegrityError,
    UsageError,
)
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
    build_header,
    header_length,
    header_size_limit,
    parse_header,
)
from ckptvault.io.dcp_metadata import dtype_from_name, dtype_name
from ckptvault.io.load import prepare_load, rejection
from ckptvault.restoring.selector import CandidateSelector
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import TrustPolicy
from ckptvault.trust.chunk_layout import check_chunk_locations
from ckptvault.trust.context import TrustContext
from ckptvault.trust.envelope import binding, segment_ad

T = TypeVar("T")
Progress = Callable[[int, int], None]  # (tensor bytes written so far, of how many)
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")  # both layouts' files
DEFAULT_MAX_SHARD = 5 * 10**9  # bytes: Hugging Face's default, "5GB"


@dataclass(frozen=True)
class OutputTensor:
    """One tensor of the output: its name there, its key in the generation, its
    shape, and the dtype written (the stored one, or a cast of it)."""

    name: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class VerifiedTensors:
    """Whole tensors of one generation that passed the restore checks, read one at
    a time. Every stored byte is matched against its chunk digest before it is
    copied anywhere; encrypted files are decrypted segment by segment (AES-GCM
    authenticates each) and their tensor header is tied to the manifest, as restore
    does. Holds one digest chunk and one segment besides the tensor it reads.
    Read failures raise :class:`GenerationRejected` (the caller tries the next one).
    """

    def __init__(
        self, store: Store, ref: GenerationRef, manifest: Manifest, data_keys: dict[str, bytes]
    ) -> None:
        self.store, self.ref, self.manifest, self.data_keys = store, ref, manifest, data_keys
        self.entries: dict[str, Any] = manifest.dcp["tensors"]
        self._block: tuple[str, int, memoryview] | None = None
        self._segment: tuple[str, int, bytes] | None = None
        self._containers: dict[str, ContainerHeader] = {}

    def read(self, key: str) -> torch.Tensor:
        """The full tensor ``key``, in a fresh buffer the caller owns."""
        try:
            return self._assemble(key)
        except (CheckpointError, OSError) as exc:
            raise rejection(self.ref, exc) from exc

    def _assemble(self, key: str) -> torch.Tensor:
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
            encrypted = chunk["file"] in self.data_keys
            read_into = self._read_plaintext if encrypted else self._read_stored
            if region.is_contiguous():  # whole tensors, row shards: straight into place
                read_into(chunk["file"], chunk["start"], _bytes_of(region))
            else:
                staging = torch.empty(chunk["length"], dtype=torch.uint8)
                read_into(chunk["file"], chunk["start"], staging.numpy().data)
                region.copy_(staging.view(dtype).reshape(chunk["sizes"]))
        return full

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
        if self._block is not None and self._block[:2] == (name, index):
            return self._block[2]
        self._block = None
        record, size = self.manifest.files[name], self.manifest.chunk_size
        where = f"{self.ref.location}/{name}"
        length = min(size, record.size - index * size)
        if index >= len(record.chunks) or length <= 0:
            raise IntegrityError(f"{where}: byte {index * size} lies beyond the recorded size")
        data = self.store.read_range(self.ref, name, index * size, length)
        if len(data) != length or blake3(data).hexdigest() != record.chunks[index]:
            raise IntegrityError(
                f"{where}: bytes {index * size}..{index * size + length} (chunk {index + 1} of "
                f"{len(record.chunks)}) do not match the manifest digest: the file changed "
                "after it was written; nothing of it was used"
            )
        self._block = (name, index, memoryview(data))
        return self._block[2]

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
        held = [c["name"] for i in self.entries.values() for c in i["chunks"] if c["file"] == name]
        limit = header_size_limit(held)
        prefix = bytearray(min(HEADER_LENGTH_BYTES, plaintext_size))
        self._read_plaintext(name, 0, memoryview(prefix))
        raw = bytearray(header_length(bytes(prefix), plaintext_size, name, limit))
        self._read_plaintext(name, 0, memoryview(raw))
        parsed = parse_header(bytes(raw), plaintext_size, name, limit)
        problems = check_chunk_locations(self.manifest, {name: parsed})
        if problems:
            raise FormatError("; ".join(str(p) for p in problems))


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's own memory, as bytes (writable)."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def plan_shards(tensors: Sequence[OutputTensor], limit: int) -> list[list[OutputTensor]]:
    """Pack ``tensors``, in order, into shards of at most ``limit`` bytes (a larger
    tensor gets a shard of its own), as Hugging Face does."""
    shards: list[list[OutputTensor]] = [[]]
    filled = 0
    for tensor in tensors:
        if shards[-1] and filled + tensor.nbytes > limit:
            shards.append([])
            filled = 0
        shards[-1].append(tensor)
        filled += tensor.nbytes
    return shards


def write_tensor_file(
    path: Path,
    tensors: Sequence[OutputTensor],
    source: VerifiedTensors,
    metadata: Mapping[str, str],
    progress: Callable[[int], None] | None = None,
) -> tuple[str, int]:
    """Write a new safetensors file at ``path`` (which must not exist) holding one
    tensor in memory at a time; returns the file's BLAKE3 digest and size. Not
    durable by itself: write it under :func:`~ckptvault.durable.atomic_path`."""
    header = build_header(((t.name, dtype_name(t.dtype), t.shape) for t in tensors), metadata)
    hasher = blake3(header.header_bytes)
    with open(path, "xb") as handle:
        handle.write(header.header_bytes)
        for item in tensors:
            tensor = source.read(item.key)
            if tensor.dtype != item.dtype:
                tensor = tensor.to(item.dtype)  # the stored copy is freed right here
            if tensor.numel():
                hasher.update(_bytes_of(tensor))
                handle.write(_bytes_of(tensor))
            del tensor  # before the next one is allocated
            if progress is not None:
                progress(item.nbytes)
        size = handle.tell()
    return hasher.hexdigest(), size


def meter(progress: Progress | None, tensors: Sequence[OutputTensor]) -> Callable[[int], None]:
    """Per-tensor byte counts turned into ``progress(done, total)`` calls."""
    total, done = sum(t.nbytes for t in tensors), [0]

    def advance(count: int) -> None:
        done[0] += count
        if progress is not None:
            progress(done[0], total)

    return advance


def write_sharded(
    directory: Path,
    shards: Sequence[Sequence[OutputTensor]],
    source: VerifiedTensors,
    metadata: Mapping[str, str],
    progress: Progress | None = None,
) -> tuple[list[Path], Path | None]:
    """Write ``shards`` into ``directory`` as ``model.safetensors`` (one shard) or a
    Hugging Face sharded set and its index; returns the files and the index.

    Every shard is written under a temporary name first; on any error they are all
    removed and nothing in ``directory`` changed. Files of an earlier consolidation
    into ``directory`` that the new layout does not use are removed at the end."""
    total = len(shards)
    names = [f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1)]
    names = names if total > 1 else [SINGLE_FILE]
    paths = [directory / name for name in names]
    advance = meter(progress, [t for shard in shards for t in shard])
    with contextlib.ExitStack() as stack:
        for path, shard in zip(paths, shards, strict=True):
            write_tensor_file(
                stack.enter_context(atomic_path(path)), shard, source, metadata, advance
            )
        # No old index may describe a half-renamed set: the new index is written last.
        (directory / INDEX_FILE).unlink(missing_ok=True)
    index = None
    if total > 1:
        index = directory / INDEX_FILE
        weight_map = {
            t.name: name for name, shard in zip(names, shards, strict=True) for t in shard
        }
        document = {
            "metadata": {"total_size": sum(t.nbytes for shard in shards for t in shard)},
            "weight_map": dict(sorted(weight_map.items())),
        }
        write_atomically(index, (json.dumps(document, indent=2) + "\n").encode())
    for stale in directory.iterdir():  # an earlier layout's files
        if stale.name not in names and SHARD_NAME.fullmatch(stale.name):
            stale.unlink(missing_ok=True)
    return paths, index


def stream_generation(
    store: Store,
    run_id: str,
    step: int,
    trust: TrustContext,
    write: Callable[[Manifest, Any, VerifiedTensors], T],
) -> tuple[Manifest, T]:
    """Run ``write(manifest, state tree, tensors)`` on the newest generation of
    ``step`` that passes the restore checks, as export always has: run
    ``run_id``'s own, abandoned generations refused, no floor (reading an old step
    never rewinds a run), in an encrypted run never a plaintext generation. When
    ``write`` raises :class:`GenerationRejected` (a chunk failed its digest) the
    next generation of the step is tried; ``write`` must have left nothing behind.
    Raises :class:`NoValidCheckpoint` when none verifies."""
    selector = CandidateSelector(store, run_id, trust)
    selection = selector.select(step, floor_applies=False)  # never empty: a step is given

    def attempt(ref: GenerationRef, policy: TrustPolicy) -> tuple[Manifest, T]:
        encrypted_run = trust.keystore is not None
        prepared = prepare_load(store, ref, policy, trust.keystore, encrypted_run)
        manifest = prepared.checked.manifest
        source = VerifiedTensors(store, ref, manifest, prepared.data_keys)
        return manifest, write(manifest, prepared.tree, source)

    return selector.first_verified(selection, attempt)[1]


def prefixed_tensors(
    manifest: Manifest, prefix: str, dtype: torch.dtype | None
) -> list[OutputTensor]:
    """The tensors whose keys lie under ``prefix`` (``model/``; empty: all), named
    by the rest of their key path joined with dots (``model/layer/weight`` ->
    ``layer.weight``), floating point ones cast to ``dtype``; sorted by name."""
    base = [part for part in prefix.split("/") if part]
    found: dict[str, OutputTensor] = {}
    for key, info in manifest.dcp["tensors"].items():
        parts = key.split("/")
        if parts[: len(base)] != base:
            continue
        name = ".".join(_unescape(part) for part in parts[len(base) :] or parts[-1:])
        if name in found:
            raise UsageError(
                f"tensors {found[name].key!r} and {key!r} would both be named {name!r}; "
                "consolidate a narrower --prefix"
            )
        stored = dtype_from_name(info["dtype"], f"tensor {key[:200]!r}")
        cast = dtype if dtype is not None and stored.is_floating_point else stored
        found[name] = OutputTensor(name, key, tuple(info["shape"]), cast)
    if not found:
        keys = ", ".join(sorted({k.split("/")[0] + "/" for k in manifest.dcp["tensors"]})[:10])
        raise UsageError(f"no tensor of the checkpoint lies under {prefix!r}; prefixes: {keys}")
    return [found[name] for name in sorted(found)]


def _unescape(segment: str) -> str:
    """Undo :func:`ckptvault.state.codec_names.tensor_key`'s escaping of a segment."""
    return segment.replace("~1", "/").replace("~0", "~")
