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
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from blake3 import blake3

from ckptvault.durable import atomic_path, write_atomically
from ckptvault.errors import (
    UsageError,
)
from ckptvault.format.manifest import Manifest
from ckptvault.format.tensorfile import (
    build_header,
)
from ckptvault.io.dcp_metadata import dtype_from_name, dtype_name
from ckptvault.io.load import prepare_load
from ckptvault.io.verified_ranges import VerifiedRanges, bytes_of
from ckptvault.progress import Meter, Progress  # here: (tensor bytes written, of how many)
from ckptvault.restoring.selector import CandidateSelector
from ckptvault.state.names import plain_name
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import TrustPolicy
from ckptvault.trust.context import TrustContext

T = TypeVar("T")
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
    source: VerifiedRanges,
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
                hasher.update(bytes_of(tensor))
                handle.write(bytes_of(tensor))
            del tensor  # before the next one is allocated
            if progress is not None:
                progress(item.nbytes)
        size = handle.tell()
    return hasher.hexdigest(), size


def meter(progress: Progress | None, tensors: Sequence[OutputTensor]) -> Callable[[int], None]:
    """Per-tensor byte counts turned into ``progress(done, total)`` calls (from
    ``(0, total)``; a callback that raises stops the work, see :mod:`ckptvault.progress`)."""
    return Meter(progress, sum(t.nbytes for t in tensors))


def write_sharded(
    directory: Path,
    shards: Sequence[Sequence[OutputTensor]],
    source: VerifiedRanges,
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
    write: Callable[[Manifest, Any, VerifiedRanges], T],
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
        source = VerifiedRanges(store, ref, manifest, prepared.data_keys)
        return manifest, write(manifest, prepared.tree, source)

    return selector.first_verified(selection, attempt)[1]


def prefixed_tensors(
    manifest: Manifest,
    prefix: str,
    dtype: torch.dtype | None,
    aliases: Mapping[str, str] | None = None,
) -> list[OutputTensor]:
    """The tensors whose keys lie under ``prefix`` (``model/``; empty: all), named
    by the rest of their key path joined with dots (``model/layer/weight`` ->
    ``layer.weight``, without ``torch.compile``'s ``_orig_mod.``), and ``aliases``
    (name -> key: tied weights) under their names; floating point ones cast to
    ``dtype``; sorted by name."""
    base = [part for part in prefix.split("/") if part]
    found: dict[str, OutputTensor] = {}
    for key, info in manifest.dcp["tensors"].items():
        parts = key.split("/")
        if parts[: len(base)] != base:
            continue
        # Plain names: a compiled model's (older) checkpoint exports as the plain one.
        name = plain_name(".".join(_unescape(part) for part in parts[len(base) :] or parts[-1:]))
        if name in found:
            raise UsageError(
                f"tensors {found[name].key!r} and {key!r} would both be named {name!r}; "
                "consolidate a narrower --prefix"
            )
        stored = dtype_from_name(info["dtype"], f"tensor {key[:200]!r}")
        cast = dtype if dtype is not None and stored.is_floating_point else stored
        found[name] = OutputTensor(name, key, tuple(info["shape"]), cast)
    for alias, key in (aliases or {}).items():  # tied weights: each name gets its tensor
        info, name = manifest.dcp["tensors"][key], plain_name(alias)
        stored = dtype_from_name(info["dtype"], f"tensor {key[:200]!r}")
        cast = dtype if dtype is not None and stored.is_floating_point else stored
        found.setdefault(name, OutputTensor(name, key, tuple(info["shape"]), cast))
    if not found:
        keys = ", ".join(sorted({k.split("/")[0] + "/" for k in manifest.dcp["tensors"]})[:10])
        raise UsageError(f"no tensor of the checkpoint lies under {prefix!r}; prefixes: {keys}")
    return [found[name] for name in sorted(found)]


def _unescape(segment: str) -> str:
    """Undo :func:`ckptvault.state.codec_names.tensor_key`'s escaping of a segment."""
    return segment.replace("~1", "/").replace("~0", "~")
