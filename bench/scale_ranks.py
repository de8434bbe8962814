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
  writer lays them out (at most 8 files a rank, none under 64 MiB, safetensors
  headers), one file record per file with one digest per 4 MiB chunk, the DCP
  metadata as ckptvault stores it (``metadata_to_json``), the state tree, and a real
  :class:`~ckptvault.format.manifest.Manifest` encoded to its canonical bytes.
- **what a rank reads**: :func:`manifest_bytes_for` is the one function that says
  which documents a rank reads before restoring and how large they are; today that
  is the single ``manifest.json``. When the format becomes a small root plus
  per-file indexes, it changes there and the axis measures the new format.
- **parse**: the time to parse and check those documents
  (:func:`ckptvault.format.manifest.parse_manifest`).

A manifest over ckptvault's 64 MiB read cap cannot be saved today
(``Manifest.to_bytes`` refuses it); its size is still measured (the same canonical
bytes, uncapped) and its parse time with the cap lifted for the measurement only,
and the row says so.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
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
from ckptvault.format.layout import generation_created_at, new_generation_id, tensor_file_name
from ckptvault.format.manifest import Manifest, parse_manifest
from ckptvault.format.records import FileRecord
from ckptvault.format.tensorfile import build_header
from ckptvault.io.dcp_metadata import StoredChunk, dtype_name, metadata_to_json
from ckptvault.io.planners import TensorOnlySavePlanner
from ckptvault.io.writer import MIN_FILE_BYTES, chunk_name
from ckptvault.state.capture import capture_state
from ckptvault.state.ranks import compose
from ckptvault.trust.digests import DEFAULT_CHUNK_SIZE

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


def _files_of(items: list[WriteItem]) -> list[list[WriteItem]]:
    """A rank's items split over its files, largest first (as ckptvault's writer)."""
    total = sum(_nbytes(i) for i in items)
    count = max(1, min(WRITER_FILES, len(items), math.ceil(total / MIN_FILE_BYTES)))
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
    return FileRecord(size=size, blake3=os.urandom(32).hex(), chunks=chunks)


def lay_out(
    plans: list[SavePlan],
) -> tuple[dict[MetadataIndex, StoredChunk], dict[str, FileRecord]]:
    """Where every chunk's bytes would live, and the record of every file."""
    locations: dict[MetadataIndex, StoredChunk] = {}
    records: dict[str, FileRecord] = {}
    for rank, plan in enumerate(plans):
        for index, items in enumerate(_files_of(list(plan.items))):
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


def encode(manifest: Manifest) -> tuple[bytes, bool]:
    """The manifest's canonical bytes, and whether ckptvault would write them (False:
    over the read cap, ``to_bytes`` refuses; the bytes are what it would have been)."""
    try:
        return manifest.to_bytes(), True
    except manifest_format.FormatError:
        document = manifest.to_json()
        document[manifest_format.SELF_DIGEST_KEY] = blake3(dumps_canonical(document)).hexdigest()
        data = dumps_canonical(document)
        if len(data) <= manifest_format.MAX_MANIFEST_BYTES:
            raise  # refused for another reason: not a size measurement
        return data, False


def manifest_documents(manifest: Manifest, rank: int = 0) -> dict[str, bytes]:
    """The metadata documents ``rank`` reads and verifies before it can restore, by
    name. Format versions 1-2: the one ``manifest.json``, whatever the rank. (The
    seam for the next format: a small root plus the indexes of the rank's files.)"""
    data, _written = encode(manifest)
    return {manifest_format.MANIFEST_NAME: data}


def manifest_bytes_for(manifest: Manifest, rank: int = 0) -> dict[str, int]:
    """Size in bytes of every document ``rank`` reads before restoring."""
    return {name: len(data) for name, data in manifest_documents(manifest, rank).items()}


def manifest_sections(manifest: Manifest, total: int) -> dict[str, int]:
    """Bytes of the manifest's ``files`` (sizes, file and chunk digests) and ``state``
    sections; the rest is ``dcp`` (chunk metadata) and a few small keys."""
    files = len(dumps_canonical({n: r.to_json() for n, r in manifest.files.items()}))
    state = len(dumps_canonical(manifest.state))
    return {"files": files, "state": state, "dcp and the rest": total - files - state}


@contextlib.contextmanager
def _read_cap_lifted(size: int) -> Iterator[None]:
    """Let ``parse_manifest`` read ``size`` bytes, for this measurement only."""
    cap = manifest_format.MAX_MANIFEST_BYTES
    manifest_format.MAX_MANIFEST_BYTES = max(cap, size)
    try:
        yield
    finally:
        manifest_format.MAX_MANIFEST_BYTES = cap


def parse_documents(documents: dict[str, bytes]) -> float:
    """Seconds to parse and check every document (the cap lifted where needed)."""
    started = time.perf_counter()
    for name, data in documents.items():
        with _read_cap_lifted(len(data)):
            parse_manifest(data, f"scale-bench/{name}")
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
    writable: bool  # under the read cap: ckptvault would save it

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
    locations, records = lay_out(final_plans)
    started = time.perf_counter()
    manifest = build_manifest(captured.tree, metadata, locations, records, ranks)
    documents = manifest_documents(manifest)
    encode_s = time.perf_counter() - started
    writable = all(len(d) <= manifest_format.MAX_MANIFEST_BYTES for d in documents.values())
    sections = manifest_sections(manifest, sum(len(d) for d in documents.values()))
    parse_s = parse_documents(documents)
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
    )
