"""DCP save plans between ranks as JSON: each rank's local plan to rank 0, and each
rank's part of the global plan back.

A local plan is what DCP's planner wants written from this rank; ckptvault hands DCP
tensors only, so each item is a tensor (``"tensor"``, written whole) or a shard of
one (``"shard"``, a DTensor's local box)::

    {"items": [[fqn, "tensor" | "shard", dtype, shape, offsets, sizes], ...]}

Rank 0 rebuilds DCP's ``WriteItem`` from each after checking every field: the name
is a bounded string, the dtype one of the names tensor files hold
(:data:`~ckptvault.format.tensorfile.DTYPES`, never ``getattr(torch, name)`` on
what a peer sent), the shape bounded, the box inside it, no item twice, at most
:data:`MAX_LOCAL_CHUNKS` chunks of one tensor.

DCP's global plan for a rank is its local plan with some items dropped (a replicated
tensor is written once) and each item's chunk-index hint set. That is what rank 0
sends back — which of the rank's own items to write, and their hints::

    {"keep": [[position in the local plan, hint], ...]}

so each rank writes items it built itself, never items another rank described.
:func:`assignment` checks that the global plan is exactly that.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ckptvault.distributed.wire import MAX_HINT, Field
from ckptvault.errors import FormatError, SaveFailedError
from ckptvault.format.index import MAX_ENTRY_NAME_CHARS
from ckptvault.format.tensor_table import MAX_CELLS
from ckptvault.format.tensorfile import DTYPES, MAX_TENSOR_BYTES, MAX_TENSOR_RANK, checked_shape
from ckptvault.io.dcp_metadata import dtype_from_name, dtype_name

_KINDS = {"tensor": WriteItemType.TENSOR, "shard": WriteItemType.SHARD}
# Chunks of one tensor in one rank's plan: a tensor or a DTensor's local shard is one.
# DCP checks the global plan's chunks for overlaps pairwise among those that span its
# sweep: thousands of one tensor's column chunks from one rank kept rank 0 computing
# for hours (past every collective's timeout) from a message of a few megabytes.
MAX_LOCAL_CHUNKS = 8
_NAMES = {kind: name for name, kind in _KINDS.items()}
_HEX64_RE = re.compile(r"^[0-9a-f]{64}\Z")


def plan_to_json(plan: SavePlan) -> dict[str, Any]:
    """This rank's local plan as a message; FormatError for what ckptvault does not
    write (a non-tensor, a dtype tensor files cannot hold, more than
    :data:`MAX_LOCAL_CHUNKS` chunks of one tensor): this rank's own error."""
    items = []
    for item in plan.items:
        data = item.tensor_data
        if item.type not in _NAMES or data is None:
            raise FormatError(f"{item.index.fqn!r} is not a tensor; ckptvault never pickles")
        dtype = dtype_name(data.properties.dtype)
        if dtype not in DTYPES:
            raise FormatError(
                f"tensor {item.index.fqn!r} has dtype {dtype}, which no tensor file holds"
            )
        items.append(
            [
                item.index.fqn,
                _NAMES[item.type],
                dtype,
                list(data.size),
                list(data.chunk.offsets),
                list(data.chunk.sizes),
            ]
        )
    per_tensor = Counter(item[0] for item in items)
    crowded = [fqn for fqn, count in per_tensor.items() if count > MAX_LOCAL_CHUNKS]
    if crowded:
        raise FormatError(
            f"tensor {crowded[0]!r} has {per_tensor[crowded[0]]} local chunks on this rank; "
            f"ckptvault saves at most {MAX_LOCAL_CHUNKS} per rank (a DTensor has one): "
            "save it as a DTensor"
        )
    return {"items": items}


def plan_from_json(raw: Any, rank: int) -> SavePlan:
    """Rank ``rank``'s local plan, every field checked; PeerMessageError otherwise."""
    field = Field(rank, "a save plan")
    items = field.sequence(field.mapping(raw, ("items",), "the plan")["items"], "items")
    if len(items) > MAX_CELLS:
        raise field.refuse(f"{len(items)} items, more than the {MAX_CELLS} a generation holds")
    plan = [_item(entry, field) for entry in items]
    seen = {(item.index.fqn, item.index.offset) for item in plan}
    if len(seen) != len(plan):
        raise field.refuse("an item listed twice")
    per_tensor = Counter(item.index.fqn for item in plan)
    crowded = [fqn for fqn, count in per_tensor.items() if count > MAX_LOCAL_CHUNKS]
    if crowded:
        raise field.refuse(
            f"{per_tensor[crowded[0]]} chunks of tensor {crowded[0][:100]!r}, more than the "
            f"{MAX_LOCAL_CHUNKS} one rank holds"
        )
    return SavePlan(plan)


def _item(raw: Any, field: Field) -> WriteItem:
    fqn, kind, dtype, shape, offsets, sizes = field.sequence(raw, "an item", 6)
    fqn = field.text(fqn, "a tensor name", MAX_ENTRY_NAME_CHARS)
    kind = field.choice(kind, "an item's kind", _KINDS)
    dtype = field.choice(dtype, "a dtype", DTYPES)
    try:
        dims = checked_shape(shape, dtype, f"tensor {fqn[:100]!r}")
    except FormatError as exc:
        raise field.refuse(str(exc)) from exc
    rank = len(dims)
    box = field.counts(offsets, "offsets", rank, MAX_TENSOR_BYTES)
    extent = field.counts(sizes, "sizes", rank, MAX_TENSOR_BYTES)
    if any(o + s > d for o, s, d in zip(box, extent, dims, strict=True)):
        raise field.refuse(f"tensor {fqn[:100]!r}: a box outside its shape")
    if kind == "tensor" and (any(box) or extent != list(dims)):
        raise field.refuse(f"tensor {fqn[:100]!r}: a whole tensor's box must be all of it")
    assert rank <= MAX_TENSOR_RANK  # checked_shape's bound
    offset = torch.Size(box)
    return WriteItem(
        index=MetadataIndex(fqn, offset),
        type=_KINDS[kind],
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offset, sizes=torch.Size(extent)),
            properties=TensorProperties(dtype=dtype_from_name(dtype, fqn)),
            size=torch.Size(dims),
        ),
    )


def check_agreement(plans: list[SavePlan]) -> None:
    """Every rank describes a tensor alike (dtype, shape): DCP keeps one rank's
    description in the metadata, which must fit every rank's chunks."""
    seen: dict[str, tuple[int, TensorWriteData]] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            data = item.tensor_data
            assert data is not None  # plan_from_json built it
            first = seen.setdefault(item.index.fqn, (rank, data))
            if (first[1].properties.dtype, first[1].size) != (data.properties.dtype, data.size):
                raise SaveFailedError(
                    f"ranks {first[0]} and {rank} hold tensor {item.index.fqn[:200]!r} as "
                    f"{first[1].properties.dtype} {list(first[1].size)} and "
                    f"{data.properties.dtype} {list(data.size)}: every rank must save the "
                    "same tensors with the same shapes and dtypes"
                )


def assignment(local: SavePlan, central: SavePlan, rank: int) -> dict[str, Any]:
    """The message telling rank ``rank`` which of its ``local`` items DCP's global
    plan ``central`` kept, and their hints. SaveFailedError when the global plan is
    anything else (a planner that moved, changed or added items)."""
    if central.storage_data is not None or central.planner_data is not None:
        raise SaveFailedError(
            f"DCP's global plan for rank {rank} carries storage or planner data, which "
            "ckptvault does not send between ranks"
        )
    kept: list[list[int]] = []
    position = 0
    for item in central.items:
        while position < len(local.items) and not _same(local.items[position], item):
            position += 1
        if position == len(local.items):
            raise SaveFailedError(
                f"DCP's global plan for rank {rank} holds {item.index.fqn[:200]!r} in a "
                "form the rank's own plan does not: ckptvault's planner only drops items "
                "and sets their hints"
            )
        hint = item.index.index or 0
        if not 0 <= hint <= MAX_HINT:
            raise SaveFailedError(f"DCP's global plan for rank {rank}: chunk hint {hint}")
        kept.append([position, hint])
        position += 1
    return {"keep": kept}


def _same(mine: WriteItem, planned: WriteItem) -> bool:
    # MetadataIndex compares by name and offset (its hint is left out).
    return (
        mine.index == planned.index
        and mine.type == planned.type
        and mine.tensor_data == planned.tensor_data
    )


def assigned_plan(local: SavePlan, raw: Any) -> SavePlan:
    """This rank's part of the global plan, from rank 0's message: its own items,
    in order, each with its hint. PeerMessageError for anything else."""
    field = Field(0, "a plan assignment")
    kept = field.sequence(field.mapping(raw, ("keep",), "the assignment")["keep"], "keep")
    items = []
    last = -1
    for entry in kept:
        position, hint = field.sequence(entry, "a kept item", 2)
        position = field.count(position, "a position", last + 1, len(local.items) - 1)
        hint = field.count(hint, "a chunk hint", 0, MAX_HINT)
        item = local.items[position]
        items.append(dataclasses.replace(item, index=dataclasses.replace(item.index, index=hint)))
        last = position
    return dataclasses.replace(local, items=items)


def announcement(raw: Any, rank: int) -> tuple[str, bool, Any]:
    """What rank ``rank`` sent before planning: its local plan's digest, whether it
    holds rank 0's assignment for a plan of that digest
    (:mod:`~ckptvault.distributed.plan_cache`) and, unless it does, its plan
    message (checked by :func:`plan_from_json` when rank 0 plans); PeerMessageError
    otherwise."""
    field = Field(rank, "its plan")
    message = field.mapping(raw, ("digest", "held", "plan"), "the announcement")
    digest, held, plan = message["digest"], message["held"], message["plan"]
    if not isinstance(digest, str) or not _HEX64_RE.match(digest) or type(held) is not bool:
        raise field.refuse("a digest of 64 hex digits and whether it holds its assignment")
    if (plan is None) != held:
        raise field.refuse("a plan exactly when it holds no assignment")
    return digest, held, plan
