"""The simulated rank-count axis: DCP plans for N ranks built in one process.

No process group is started. A GPT-like model (``layers`` x 12 parameters + 3:
723 parameters at 60 layers, the issue's figure) is built on the meta device, its
state captured the way ckptvault captures it, and every parameter is sharded along
dim 0 into N chunks as FSDP2's ``Shard(0)`` does (``torch.chunk``: the last ranks
may hold empty chunks). Each rank's local ``SavePlan`` is made of the ``WriteItem``s
DCP makes for such DTensor shards; then, as the coordinator of a real save would:

- **global plan**: ckptvault's save planner (DCP's ``DefaultSavePlanner``, tensors
  only) runs ``create_global_plan`` over the N local plans: dedup, the global
  ``Metadata``, its validation. Timed.
- **the generation's metadata**: every rank's items laid out in files as ckptvault's
  writer lays them out (at most 8 files a rank, fewer past 512 ranks so that a
  generation has at most 4,096; none under 64 MiB; safetensors headers), one file
  record per file with one digest per 4 MiB chunk, and a real format-3
  :class:`~ckptvault.format.manifest.Manifest`: its per-rank indexes written by
  ckptvault's own index writer (into memory) and its root encoded to canonical bytes.
- **what a rank reads**: :func:`manifest_documents` says which documents rank 0
  reads and verifies before restoring its shards: the root, and the indexes the
  restore's own selection picks for its shards.
- **parse**: the time to parse and check those documents as a restore does (the
  root, then each index matched against its digest, parsed, checked against the
  root's tensor table).

A root over ckptvault's cap cannot be saved (``Manifest.to_bytes`` refuses it); its
size is still measured (the same canonical bytes, uncapped) and the row says so.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from blake3 import blake3
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

import ckptvault.format.manifest as manifest_format
from ckptvault import __version__
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.layout import (
    MANIFEST_NAME,
    GenerationName,
    generation_created_at,
    new_generation_id,
    tensor_file_name,
)
from ckptvault.format.manifest import MAX_ROOT_BYTES, Manifest, parse_manifest
from ckptvault.format.records import FileRecord
from ckptvault.format.tensor_table import Box
from ckptvault.format.tensorfile import build_header
from ckptvault.io.dcp_metadata import StoredChunk, dtype_name, metadata_to_json
from ckptvault.io.planners import TensorOnlySavePlanner
from ckptvault.io.writer import MIN_FILE_BYTES, chunk_name, files_per_rank
from ckptvault.saving.indexes import IndexWriter
from ckptvault.state.capture import capture_state
from ckptvault.state.ranks import compose
from ckptvault.storage.base import GenerationRef
from ckptvault.trust.digests import DEFAULT_CHUNK_SIZE, derived_file_digest
from ckptvault.trust.indexes import indexes_for_regions, load_indexes

WRITER_FILES = 8  # a GPU node's writer: default_threads() is min(8, cores)
MANIFEST_TARGET = 1_000_000  # the bound on the root manifest at 1,024 x 723


# -- the model -------------------------------------------------------------------------


class _Block(torch.nn.Module):
    """A GPT-2 block: 12 parameters (two norms, fused QKV, projections, MLP)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(width)
        self.attn = torch.nn.ModuleDict(
            {"c_attn": torch.nn.Linear(width, 3 * width), "c_proj": torch.nn.Linear(width, width)}
        )
        self.ln_2 = torch.nn.LayerNorm(width)
        self.mlp = torch.nn.ModuleDict(
            {"c_fc": torch.nn.Linear(width, 4 * width), "c_proj": torch.nn.Linear(4 * width, width)}
        )


def gpt_model(layers: int = 60, width: int = 18432, vocab: int = 50304) -> torch.nn.Module:
    """A GPT-like model on the meta device: ``12 * layers + 3`` parameters. The
    defaults give 723 parameters and about 980 GB of float32 state (so 234,000
    chunks of 4 MiB): the issue's frontier run."""
    with torch.device("meta"):
        model = torch.nn.Module()
        model.wte = torch.nn.Embedding(vocab, width)
        model.h = torch.nn.ModuleList(_Block(width) for _ in range(layers))
        model.ln_f = torch.nn.LayerNorm(width)
    # Capture refuses meta tensors (they hold no data): each parameter becomes one
    # element expanded to its shape, a real tensor that takes no memory.
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            hollow = torch.zeros((1,) * param.dim()).expand(param.shape)
            setattr(module, name, torch.nn.Parameter(hollow, requires_grad=False))
    return model


# -- plans -----------------------------------------------------------------------------


def _shard(size: int, ranks: int, rank: int) -> tuple[int, int]:
    """(offset, length) of ``rank``'s chunk of ``size`` rows, as ``torch.chunk``."""
    step = -(-size // ranks)
    offset = min(rank * step, size)
    return offset, max(0, min(step, size - offset))


def local_plans(tensors: dict[str, torch.Tensor], ranks: int) -> list[SavePlan]:
    """Each rank's local save plan: one item per parameter shard (a plain tensor
    item on one rank), as DCP makes for DTensors sharded on dim 0."""
    properties = {t.dtype: TensorProperties(dtype=t.dtype) for t in tensors.values()}
    plans = []
    for rank in range(ranks):
        items = []
        for fqn, tensor in tensors.items():
            shape = tuple(tensor.shape)
            offset, length = _shard(shape[0], ranks, rank) if shape else (0, 0)
            offsets = torch.Size((offset, *([0] * (len(shape) - 1)))) if shape else torch.Size()
            sizes = torch.Size((length, *shape[1:])) if shape else torch.Size()
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, offsets),
                    type=WriteItemType.SHARD if ranks > 1 else WriteItemType.TENSOR,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                        properties=properties[tensor.dtype],
                        size=torch.Size(shape),
                    ),
                )
            )
        plans.append(SavePlan(items))
    return plans


def global_plan(plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
    """What the coordinator computes: ckptvault's planner over every local plan."""
    return TensorOnlySavePlanner().create_global_plan(plans)


# -- the generation's metadata ---------------------------------------------------------


def _data(item: WriteItem) -> TensorWriteData:
    assert item.tensor_data is not None  # tensor items only
    return item.tensor_data


def _nbytes(item: WriteItem) -> int:
    data = _data(item)
    return math.prod(data.chunk.sizes) * data.properties.dtype.itemsize


def _files_of(items: list[WriteItem], ranks: int) -> list[list[WriteItem]]:
    """A rank's items split over its files, largest first (as ckptvault's writer)."""
    total = sum(_nbytes(i) for i in items)
    most = files_per_rank(WRITER_FILES, ranks)
    count = max(1, min(most, len(items), math.ceil(total / MIN_FILE_BYTES)))
    bins: list[list[WriteItem]] = [[] for _ in range(count)]
    loads = [0] * count
    for item in sorted(items, key=lambda i: -_nbytes(i)):
        target = loads.index(min(loads))
        bins[target].append(item)
        loads[target] += _nbytes(item)
    return [b for b in bins if b]


def _record(size: int) -> FileRecord:
    """A file record with real-looking digests (one per 4 MiB chunk)."""
    chunks = tuple(os.urandom(32).hex() for _ in range(-(-size // DEFAULT_CHUNK_SIZE)))
    return FileRecord(size=size, blake3=derived_file_digest(size, chunks), chunks=chunks)


def lay_out(
    plans: list[SavePlan], ranks: int
) -> tuple[dict[MetadataIndex, StoredChunk], dict[str, FileRecord]]:
    """Where every chunk's bytes would live, and the record of every file."""
    locations: dict[MetadataIndex, StoredChunk] = {}
    records: dict[str, FileRecord] = {}
    for rank, plan in enumerate(plans):
        for index, items in enumerate(_files_of(list(plan.items), ranks)):
            name = tensor_file_name(rank, index)
            header = build_header(
                ((chunk_name(i), dtype_name(_data(i).properties.dtype), tuple(_data(i).chunk.sizes))
                 for i in items),
                {"format": "pt", "writer": "ckptvault"},
            )  # fmt: skip
            for item in items:
                entry = header.entries[chunk_name(item)]
                locations[item.index] = StoredChunk(name, entry.name, entry.start, entry.nbytes)
            records[name] = _record(header.data_start + sum(_nbytes(i) for i in items))
    return locations, records


def build_manifest(
    tree: dict[str, Any],
    metadata: Metadata,
    locations: dict[MetadataIndex, StoredChunk],
    records: dict[str, FileRecord],
    ranks: int,
) -> Manifest:
    """The manifest the coordinator would publish for this save (no per-rank entries)."""
    generation_id = new_generation_id()
    return Manifest(
        run_id="scale-bench",
        step=1000,
        generation_id=generation_id,
        created_at=generation_created_at(generation_id),
        parent=None,
        chunk_size=DEFAULT_CHUNK_SIZE,
        files=records,
        dcp=metadata_to_json(metadata, locations),
        state=compose(tree, [{} for _ in range(ranks)]) if ranks > 1 else tree,
        contract={"user": {"config": {"layers": 60}}, "torch": torch.__version__},
        writer={"ckptvault": __version__, "world_size": ranks},
    )


# -- what a rank reads -----------------------------------------------------------------


class _MemoryFile:
    def __init__(self, files: dict[str, bytes], name: str) -> None:
        self.files, self.name, self.data = files, name, bytearray()

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self.data += data
        return len(memoryview(data))

    def commit(self) -> None:
        self.files[self.name] = bytes(self.data)

    def abort(self) -> None:
        pass


class MemoryGeneration:
    """A staging area and a store of one generation, in memory: what the index
    writer writes, and what the restore checks read back."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}

    def create_file(self, name: str) -> _MemoryFile:
        return _MemoryFile(self.files, name)

    def read_bytes(self, _ref: object, name: str, limit: int) -> bytes:
        return self.files[name][:limit]


def encode(manifest: Manifest, generation: MemoryGeneration) -> tuple[Manifest, bytes, bool]:
    """The manifest with its indexes written into ``generation``, its root's canonical
    bytes, and whether ckptvault would write them (False: over the cap, ``to_bytes``
    refuses; the bytes are what it would have been)."""
    manifest = IndexWriter().write(generation, manifest)  # type: ignore[arg-type]
    try:
        return manifest, manifest.to_bytes(), True
    except manifest_format.FormatError:
        document = manifest.to_json()
        document[manifest_format.SELF_DIGEST_KEY] = blake3(dumps_canonical(document)).hexdigest()
        data = dumps_canonical(document)
        if len(data) <= manifest_format.MAX_ROOT_BYTES:
            raise  # refused for another reason: not a size measurement
        return manifest, data, False


def rank_regions(manifest: Manifest, ranks: int, rank: int) -> dict[str, list[Box] | None]:
    """The part of every tensor rank ``rank`` restores: its own dim-0 shard."""
    assert manifest.tensor_table is not None
    regions: dict[str, list[Box] | None] = {}
    for fqn, layout in manifest.tensor_table.tensors.items():
        shape = layout.shape
        offset, length = _shard(shape[0], ranks, rank) if shape else (0, 0)
        regions[fqn] = [((offset, *([0] * (len(shape) - 1))), (length, *shape[1:]))]
    return regions


def manifest_documents(
    manifest: Manifest, root: bytes, generation: MemoryGeneration, ranks: int, rank: int = 0
) -> dict[str, bytes]:
    """The metadata documents ``rank`` reads and verifies before it can restore, by
    name: the root, and the indexes the restore's own selection
    (:func:`ckptvault.trust.indexes.indexes_for_regions`) picks for its shards."""
    parsed = parse_manifest(root, "scale-bench") if len(root) <= MAX_ROOT_BYTES else manifest
    wanted = indexes_for_regions(parsed, rank_regions(parsed, ranks, rank))
    return {MANIFEST_NAME: root, **{name: generation.files[name] for name in sorted(wanted)}}


def manifest_sections(manifest: Manifest, total: int) -> dict[str, int]:
    """Bytes of the root's ``files`` (sizes and file digests), ``indexes`` and tensor
    table; the rest is the rank's indexes (chunk metadata and digests), the state and
    a few small keys."""
    assert manifest.tensor_table is not None and manifest.indexes is not None
    files = len(dumps_canonical({n: [r.size, r.blake3] for n, r in manifest.files.items()}))
    listed = len(dumps_canonical({n: r.to_json() for n, r in manifest.indexes.items()}))
    table = len(manifest.tensor_table.encoded())
    return {
        "files": files,
        "index list": listed,
        "tensor table": table,
        "own indexes and the rest": total - files - listed - table,
    }


def parse_documents(generation: MemoryGeneration, documents: dict[str, bytes]) -> float:
    """Seconds to parse and check every document as a rank's restore does: the root,
    then its indexes, each matched against the root's digest first."""
    started = time.perf_counter()
    root = parse_manifest(documents[MANIFEST_NAME], "scale-bench")
    ref = GenerationRef(GenerationName(root.step, root.generation_id), "memory")
    wanted = [name for name in documents if name != MANIFEST_NAME]
    load_indexes(generation, ref, root, wanted)  # type: ignore[arg-type]
    return time.perf_counter() - started


# -- one point of the axis -------------------------------------------------------------


@dataclass(frozen=True)
class RankPoint:
    ranks: int
    parameters: int
    items: int
    files: int
    chunk_digests: int
    data_bytes: int  # the files' total size
    plan_s: float  # the coordinator's global plan
    encode_s: float  # building and encoding the manifest
    documents: dict[str, int]  # what rank 0 reads, name -> bytes
    sections: dict[str, int]  # where those bytes go: files, dcp, state (today's format)
    parse_s: float
    writable: bool  # under the root's cap: ckptvault would save it
    root_bytes: int = 0  # manifest.json
    index_bytes: int = 0  # every rank's index together
    indexes: int = 0

    @property
    def read_bytes(self) -> int:
        return sum(self.documents.values())


def measure_ranks(ranks: int, model: torch.nn.Module | None = None) -> RankPoint:
    """One point: plan, lay out, encode and parse the metadata of ``ranks`` ranks."""
    captured = capture_state({"model": model if model is not None else gpt_model()})
    plans = local_plans(captured.tensors, ranks)
    started = time.perf_counter()
    final_plans, metadata = global_plan(plans)
    plan_s = time.perf_counter() - started
    del plans
    locations, records = lay_out(final_plans, ranks)
    started = time.perf_counter()
    generation = MemoryGeneration()
    manifest = build_manifest(captured.tree, metadata, locations, records, ranks)
    manifest, root, writable = encode(manifest, generation)
    encode_s = time.perf_counter() - started
    documents = manifest_documents(manifest, root, generation, ranks)
    sections = manifest_sections(manifest, sum(len(d) for d in documents.values()))
    parse_s = parse_documents(generation, documents) if writable else float("nan")
    return RankPoint(
        ranks=ranks,
        parameters=len(captured.tensors),
        items=sum(len(p.items) for p in final_plans),
        files=len(records),
        chunk_digests=sum(len(r.chunks) for r in records.values()),
        data_bytes=sum(r.size for r in records.values()),
        plan_s=plan_s,
        encode_s=encode_s,
        documents={name: len(data) for name, data in documents.items()},
        parse_s=parse_s,
        writable=writable,
        sections=sections,
        root_bytes=len(root),
        index_bytes=sum(len(d) for n, d in generation.files.items()),
        indexes=len(generation.files),
    )
