"""FSDP1 and FSDP2 state through DCP's state-dict API, as shards every rank saves.

``torch.distributed.checkpoint.state_dict`` gives a sharded model's weights and
its optimizer's state keyed by parameter name (FQN), whatever the wrapper: FSDP2
(``fully_shard``) as DTensors, FSDP1 (``FullyShardedDataParallel``) as ShardedTensors
(or DTensors when FSDP1 was given a device mesh). ckptvault saves DTensors
collectively and reshards them on restore, so a ShardedTensor is viewed as the
DTensor it is: FSDP1 chunks each tensor along dim 0 over the ranks of its process
group in rank order (``torch.chunk``), as a ``Shard(0)`` placement does. The view
shares the shard's memory, so a restore's in-place copy lands in the ShardedTensor
that ``set_model_state_dict``/``set_optimizer_state_dict`` then load.

The saved form is the same for FSDP1 and FSDP2, sharded or not, whatever
``state_dict_type`` the engine was configured with (a whole model is one
``ckptvault consolidate`` away), so a generation saved by one restores into the
other and into another number of ranks.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from ckptvault.errors import StateMismatchError, UsageError
from ckptvault.state.checked import Checked, layout_problems, problems_by_part, skeleton

__all__ = ["ShardedState", "fsdp_version", "optimizer_problems"]


def fsdp_version(model: torch.nn.Module) -> int | None:
    """1 when ``model`` is or holds an FSDP1 module, 2 when it is or holds an FSDP2
    one (``fully_shard``), None for neither."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    kinds = {type(module) for module in model.modules()}
    if any(issubclass(kind, FullyShardedDataParallel) for kind in kinds):
        return 1
    if any(issubclass(kind, FSDPModule) for kind in kinds):
        return 2
    return None


class ShardedState:
    """A sharded model's weights and its optimizer's state, as DCP's state-dict API
    gives them (every rank its own shards, keyed by parameter name).

    :meth:`capture` returns ``{"model": ..., "optimizer": ...}`` to save;
    :meth:`template` the same, checked, to restore into (DCP initialises an optimizer
    that has no state yet: its moments exist, zero, as they would after a step of
    learning rate 0); :meth:`apply` loads what a restore wrote into the last capture.
    Every rank calls them in the same order: DCP's state-dict functions are
    collectives for FSDP1."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        self.model, self.optimizer = model, optimizer
        self._native: dict[str, Any] = {}
        self._captured: dict[str, Any] = {}
        self._layout: dict[str, Any] = {}  # the template's, as it was made
        self._fresh = False  # whether capturing gave the optimizer its first state
        self._meshes: dict[Any, Any] = {}

    def capture(self) -> dict[str, Any]:
        """The state to save, or the template a restore fills in place."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        self._native = {"model": get_model_state_dict(self.model)}
        self._fresh = self.optimizer is not None and not self.optimizer.state
        if self.optimizer is not None:
            self._native["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        self._captured = {key: self._as_dtensors(value) for key, value in self._native.items()}
        return self._captured

    def template(self) -> dict[str, Checked]:
        """:meth:`capture`, for a restore to fill: each entry
        :class:`~ckptvault.state.checked.Checked`, so that a generation whose entries
        DCP's setters cannot load (:meth:`problems`) is refused while the restore
        plans, before anything is applied (the tensors of the template are the live
        model's and optimizer's own)."""
        captured = self.capture()
        self._layout = skeleton(captured)
        return {
            part: Checked(value, functools.partial(self._part_problems, part))
            for part, value in captured.items()
        }

    def discard(self) -> None:
        """The template will not be applied (the restore found nothing, or raised): an
        optimizer that had no state before it was captured gets none again (DCP gave
        it a step of learning rate 0, which would shift every later step's bias
        correction)."""
        if self._fresh and self.optimizer is not None:
            self.optimizer.state.clear()
        self._fresh, self._native, self._captured, self._layout = False, {}, {}, {}

    def problems(self, state: Mapping[str, Any]) -> list[str]:
        """Why ``state`` (the layout of :meth:`capture`) cannot be loaded by DCP's
        setters, each "entry: what is wrong"; none when it can."""
        return problems_by_part(self._layout, state, self._part_problems)

    def _part_problems(self, part: str, saved: Any) -> list[str]:
        """The problems of ``saved`` as the captured ``part`` (paths relative to it):
        its layout (:func:`~ckptvault.state.checked.layout_problems`), and each
        optimizer parameter group naming the live group's parameters."""
        template = self._layout[part]
        if part == "optimizer":
            return optimizer_problems(template, saved, "")
        return layout_problems(template, saved, "", complete=False)

    def apply(self, restored: Mapping[str, Any] | None = None) -> None:
        """Load ``restored`` into the model and optimizer: by default the last
        :meth:`capture`, as a restore filled it in place (tensors copied into,
        containers' contents replaced)."""
        from torch.distributed.checkpoint.state_dict import (
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if not self._native:
            raise UsageError("ShardedState.apply before capture: capture the template first")
        restored = self._captured if restored is None else restored
        problems = self.problems(restored) if self._layout else []
        if problems:  # a restore into the template refused these already
            raise StateMismatchError(
                "cannot load into the sharded model and optimizer: "
                + "; ".join(problems[:5])
                + (f"; ... ({len(problems)} in all)" if len(problems) > 5 else "")
                + ". Nothing was loaded: restore a generation saved from this model and "
                "optimizer",
                mismatched=problems,
            )
        native = {key: _merged(self._native[key], restored[key]) for key in self._native}
        set_model_state_dict(self.model, native["model"])
        if self.optimizer is not None:
            set_optimizer_state_dict(self.model, self.optimizer, native["optimizer"])

    def _as_dtensors(self, value: Any) -> Any:
        from torch.distributed._shard.sharded_tensor import ShardedTensor

        if isinstance(value, ShardedTensor):
            return self._view(value)
        if isinstance(value, Mapping):
            return {key: self._as_dtensors(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(self._as_dtensors(item) for item in value)
        return value

    def _view(self, sharded: Any) -> Any:
        """``sharded`` (a ShardedTensor chunked along dim 0) as a DTensor sharing its
        local shard's memory."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import DTensor, Shard

        group = sharded._process_group
        world = torch.distributed.get_world_size(group)
        shards = sharded.local_shards()
        size = sharded.size()
        _check_chunked(sharded, world)
        if len(shards) > 1:
            raise UsageError("a ShardedTensor with several shards on one rank cannot be saved")
        local = shards[0].tensor if shards else torch.empty((0, *size[1:]), dtype=sharded.dtype)
        device = local.device.type
        mesh = self._meshes.get((group, device))
        if mesh is None:
            mesh = self._meshes[(group, device)] = DeviceMesh.from_group(group, device)
        contiguous = torch.empty(size, device="meta").stride()
        return DTensor.from_local(
            local, mesh, [Shard(0)], run_check=False, shape=size, stride=contiguous
        )


def optimizer_problems(layout: Any, saved: Any, where: str) -> list[str]:
    """Why ``saved`` cannot be loaded by ``set_optimizer_state_dict`` as the optimizer
    state ``layout`` (DCP's form, :func:`~ckptvault.state.checked.skeleton`) is: its
    layout, and each parameter group naming the live group's parameters."""
    problems = layout_problems(layout, saved, where, complete=False)
    if problems:
        return problems
    for index, (live, group) in enumerate(
        zip(layout["param_groups"], saved["param_groups"], strict=True)
    ):
        names = group.get("params")
        if sorted(map(str, names)) != sorted(live["params"]) or len(set(names)) != len(names):
            problems.append(
                f"{where}['param_groups'][{index}]['params']: the checkpoint's group holds "
                f"{len(names)} parameters ({', '.join(map(repr, names[:3]))}"
                f"{', ...' if len(names) > 3 else ''}), not the live group's "
                f"{len(live['params'])}: build the optimizer the run was saved with"
            )
    return problems


def _check_chunked(sharded: Any, world: int) -> None:
    """Refuse a ShardedTensor not laid out as ``Shard(0)`` over its group's ranks."""
    size = list(sharded.size())
    chunk = -(-size[0] // world) if size else 0
    for meta in sharded.metadata().shards_metadata:
        rank = meta.placement.rank()
        expected_rows = max(0, min(chunk, size[0] - rank * chunk))
        offsets = list(meta.shard_offsets)
        # An empty shard's offset says nothing (FSDP puts it at the end).
        if list(meta.shard_sizes) != [expected_rows, *size[1:]] or (
            expected_rows and offsets != [rank * chunk, *([0] * (len(size) - 1))]
        ):
            raise UsageError(
                f"a ShardedTensor of shape {size} is not chunked along dim 0 over its "
                f"{world} ranks in rank order (rank {rank} holds rows at "
                f"{list(meta.shard_offsets)}): only FSDP's layout can be saved"
            )


def _merged(native: Any, restored: Any) -> Any:
    """``native`` (DCP's form) with the values a restore wrote into its DTensor view."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    if isinstance(native, ShardedTensor):
        shards = native.local_shards()
        local = restored.to_local()
        if shards and shards[0].tensor.data_ptr() != local.data_ptr():
            shards[0].tensor.copy_(local)
        return native
    if isinstance(native, Mapping):
        return {key: _merged(item, restored[key]) for key, item in native.items()}
    if isinstance(native, list):
        return [_merged(item, other) for item, other in zip(native, restored, strict=True)]
    return restored
