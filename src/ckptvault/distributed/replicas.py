"""Replicas that disagree: silent data corruption caught at save time.

Where state is replicated — a plain tensor every DDP rank holds, the replicate
dimension of HSDP — every replica should hold the same bytes. A rank whose memory,
GPU or reduction went wrong holds different ones, and nothing else would notice:
DCP writes one replica and drops the rest. So each rank hashes (BLAKE3) every tensor
slot it holds that another rank may hold too — a plain tensor whole, a DTensor's
local shard under its global offset — and the digests are compared after they are
gathered (phase 4 of :mod:`ckptvault.distributed.save`). Every rank computes the
same verdict from the same gathered digests, so a refusal is taken together.

``on_replica_mismatch``: ``"warn"`` (default: log, audit entry, ``stats``),
``"raise"`` (refuse to publish: every rank raises ``SaveFailedError``), ``"ignore"``
(no hashing at all).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch
from blake3 import blake3
from torch.distributed.tensor import DTensor

from ckptvault.io.writer import tensor_bytes
from ckptvault.state.ranks import rank_entry

POLICIES = ("warn", "raise", "ignore")


@dataclass(frozen=True)
class Disagreement:
    """One replicated slot whose replicas differ: ranks grouped by what they hold."""

    slot: str  # the tensor key, and ``@offsets`` for a shard
    groups: tuple[tuple[int, ...], ...]  # ranks holding identical bytes, largest first

    def describe(self) -> str:
        sides = " vs ".join("ranks " + ",".join(map(str, group)) for group in self.groups)
        return f"{self.slot}: {sides}"

    def to_json(self) -> dict[str, Any]:
        return {"slot": self.slot, "groups": [list(group) for group in self.groups]}


def replica_digests(tensors: dict[str, torch.Tensor], rank: int) -> dict[str, str]:
    """BLAKE3 of every slot this rank holds that other ranks may hold as well (its
    own per-rank entries excluded), keyed by slot."""
    own = rank_entry(rank) + "/"
    digests = {}
    for key, tensor in tensors.items():
        if key.startswith(own) or _only_sharded(tensor):
            continue
        slot, local = _slot(key, tensor)
        digests[slot] = blake3(tensor_bytes(local)).hexdigest()
    return digests


def disagreements(gathered: list[dict[str, str]]) -> list[Disagreement]:
    """The slots held by several ranks whose digests differ (rank order = list order)."""
    holders: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
    for rank, digests in enumerate(gathered):
        for slot, digest in digests.items():
            holders[slot][digest].append(rank)
    found = []
    for slot in sorted(holders):
        groups = sorted(holders[slot].values(), key=lambda ranks: (-len(ranks), ranks))
        if len(groups) > 1:
            found.append(Disagreement(slot, tuple(tuple(g) for g in groups)))
    return found


def _only_sharded(tensor: torch.Tensor) -> bool:
    """A DTensor sharded along every mesh dimension: no other rank holds its shard."""
    return isinstance(tensor, DTensor) and all(p.is_shard() for p in tensor.placements)


def _slot(key: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """The slot name of a tensor and its bytes here: a DTensor's local shard under its
    global offset (ranks that hold the same shard are replicas of each other)."""
    if not isinstance(tensor, DTensor):
        return key, tensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _shape, offset = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return f"{key}@{','.join(map(str, offset))}", tensor.to_local()
