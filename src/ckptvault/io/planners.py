"""DCP planners with the pickle paths closed.

DCP's default planners serialize non-tensor values with ``torch.save`` and load
them with an unrestricted ``torch.load``: pickle. ckptvault hands DCP tensors
only (non-tensor leaves go through the JSON codec), and these subclasses make that
an enforced rule rather than a convention.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import (
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)

from ckptvault.errors import FormatError


class TensorOnlySavePlanner(DefaultSavePlanner):
    """DCP's default planner, tensors only, with plans cached per ``cache_key``.

    With a cache key, DCP reuses the previous save's plans while the state's layout
    (names, shapes, dtypes) is unchanged, and replans when it changes; ``reused_plan``
    tells which happened. Each manager uses its own key.
    """

    def __init__(self, cache_key: str | None = None) -> None:
        super().__init__(flatten_state_dict=False, enable_plan_caching=cache_key is not None)
        if cache_key is not None:
            self._cached_plans_key = f"ckptvault:{cache_key}"
        self.reused_plan = False

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        self.reused_plan = not plan.usable
        return plan

    def _dedup_save_plans(self, all_plans: list[SavePlan]) -> list[SavePlan]:
        return super()._dedup_save_plans(small_replicas_to_lowest_rank(all_plans))

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        """DCP's hook for serializing non-tensors (with ``torch.save``): refused."""
        if write_item.type == WriteItemType.BYTE_IO:
            raise FormatError(
                f"{write_item.index.fqn!r} is not a tensor; ckptvault never pickles state"
            )
        return object


# Replicated tensors smaller than this are written by the lowest rank holding them.
SMALL_REPLICA_BYTES = 1 << 20


def small_replicas_to_lowest_rank(plans: list[SavePlan]) -> list[SavePlan]:
    """Each small replicated tensor (optimizer step counters, a bias every rank holds)
    left in the lowest rank's plan only; DCP's dedup then balances the large ones
    over the ranks holding them. Spread out, the small ones would weigh nothing in
    that balance yet put a piece of every rank's index in every restore: a rank of
    many restoring its shards would read every index for a few scalars."""
    seen: dict[MetadataIndex, int] = {}
    for rank, plan in enumerate(plans):
        for item in plan.items:
            seen.setdefault(item.index, rank)
    return [
        dataclasses.replace(
            plan,
            items=[
                item
                for item in plan.items
                if seen[item.index] == rank
                or (item.tensor_storage_size() or 0) >= SMALL_REPLICA_BYTES
            ],
        )
        for rank, plan in enumerate(plans)
    ]


def forget_cached_plans(cache_key: str) -> None:
    """Drop a manager's cached plans from DCP's class-level caches."""
    key = f"ckptvault:{cache_key}"
    for cache in (
        SavePlanner._cached_save_plan,
        SavePlanner._cached_all_plans,
        SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata,
        SavePlanner._cached_final_save_plan,
    ):
        cache.pop(key, None)


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise FormatError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; refused"
        )
