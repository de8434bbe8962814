"""DCP planners with the pickle paths closed.

DCP's default planners serialize non-tensor values with ``torch.save`` and load
them with an unrestricted ``torch.load``: pickle. ckptvault hands DCP tensors
only (non-tensor leaves go through the JSON codec), and these subclasses make that
an enforced rule rather than a convention.
"""

from __future__ import annotations

import io
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType

from ckptvault.errors import FormatError


class TensorOnlySavePlanner(DefaultSavePlanner):
    def __init__(self, enable_plan_caching: bool = False) -> None:
        super().__init__(flatten_state_dict=False, enable_plan_caching=enable_plan_caching)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO:
            raise FormatError(
                f"{write_item.index.fqn!r} is not a tensor; ckptvault never pickles state"
            )
        return object


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        raise FormatError(
            f"checkpoint entry {read_item.dest_index.fqn!r} is a pickled object; refused"
        )
