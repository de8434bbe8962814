"""DeepSpeed ZeRO (stages 1, 2 and 3) state, as DeepSpeed's universal checkpoint
holds it, saved as shards every rank writes; nothing pickled.

``engine.save_checkpoint`` writes each rank's flat optimizer partition with
``torch.save`` (pickles, with loss-scaler objects inside), readable only at the same
number of ranks until ``ds_to_universal`` converts it. This module takes the state
the universal form holds, through DeepSpeed's own fragment API
(``deepspeed.utils.safe_get_full_fp32_param`` and friends): for every parameter,
by name, the fp32 master weight and each optimizer state tensor (``exp_avg``,
``exp_avg_sq``), and besides them the optimizer's step and hyperparameters and the
engine's counters. Each tensor is kept as this rank's ``Shard(0)`` chunk of it (a
DTensor over the data-parallel group), so every rank writes a share and a restore
at another number of ranks reshards; the whole tensor exists only while one
parameter is gathered or set.

Restoring gathers each parameter's chunks back, sets DeepSpeed's partitions with
``safe_set_full_*``, and copies the fp32 weights into the module's parameters
(ZeRO-3: inside ``GatheredParameters``), as a step would have left them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckptvault.errors import StateMismatchError, UsageError

__all__ = ["DeepSpeedState", "is_deepspeed_engine"]

# The engine's counters a resumed run continues from (lr schedules and gradient
# accumulation boundaries follow them).
_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
# A dynamic loss scaler's state (fp16), when the optimizer has one.
_SCALER = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


def is_deepspeed_engine(model: Any) -> bool:
    """Whether ``model`` is a ``deepspeed.DeepSpeedEngine`` (without importing
    DeepSpeed where it is not installed)."""
    return any(kind.__name__ == "DeepSpeedEngine" for kind in type(model).__mro__)


class DeepSpeedState:
    """A ZeRO engine's training state (see the module docstring).

    :meth:`capture` returns ``{"model": ..., "optimizer": ..., "engine": ...}`` to
    save; :meth:`template` the same layout, zero, for a restore to fill in place;
    :meth:`apply` loads what the restore wrote. Every rank calls each, in the same
    order: gathering and setting parameters are collectives."""

    def __init__(self, engine: Any) -> None:
        if not is_deepspeed_engine(engine):
            raise UsageError(f"DeepSpeedState takes a DeepSpeedEngine, not {type(engine).__name__}")
        stage = int(engine.zero_optimization_stage())
        if stage not in (1, 2, 3):
            raise UsageError(
                f"ckptvault saves DeepSpeed ZeRO stages 1, 2 and 3; this engine runs stage {stage}"
            )
        self.engine, self.stage = engine, stage
        self.group = engine.optimizer.dp_process_group
        self.world = torch.distributed.get_world_size(self.group)
        self.rank = torch.distributed.get_rank(self.group)
        self.params = [
            (name, param) for name, param in engine.module.named_parameters() if param.requires_grad
        ]
        self._mesh: Any = None
        self._template: dict[str, Any] = {}

    # -- what is saved -------------------------------------------------------------

    def capture(self) -> dict[str, Any]:
        """The engine's state now, each tensor this rank's chunk."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        keys = self._state_keys()
        self._link_state()
        weights: dict[str, Any] = {}
        moments: dict[str, Any] = {}
        for name, param in self.params:
            shape = self._shape(param)
            weights[name] = self._chunk(safe_get_full_fp32_param(param), shape, name)
            moments[name] = {
                key: self._chunk(safe_get_full_optimizer_state(param, key), shape, f"{name}/{key}")
                for key in keys
            }
        return {"model": weights, "optimizer": self._optimizer(moments), "engine": self._counters()}

    def template(self) -> dict[str, Any]:
        """The layout :meth:`capture` returns, zero-filled, for a restore to fill. An
        optimizer that has not stepped yet gets its state first, as DCP gives one:
        a step of learning rate 0 on zero gradients (the weights do not move; the
        state it creates is overwritten by the restore)."""
        self._init_optimizer_state()
        self._link_state()
        keys = self._state_keys()
        weights = {name: self._zeros(param) for name, param in self.params}
        moments = {name: {key: self._zeros(param) for key in keys} for name, param in self.params}
        self._template = {
            "model": weights,
            "optimizer": self._optimizer(moments),
            "engine": self._counters(),
        }
        return self._template

    # -- restoring -----------------------------------------------------------------

    def apply(self, restored: Mapping[str, Any] | None = None) -> None:
        """Load ``restored`` (by default the last :meth:`template`, as a restore
        filled it) into the engine."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        state = self._template if restored is None else restored
        if not state:
            raise UsageError("DeepSpeedState.apply before template: restore into the template")
        optimizer = state["optimizer"]
        for name, param in self.params:
            weight = state["model"][name].full_tensor()
            if self.stage == 3:
                self._set_zero3(param, weight, None)
            else:
                safe_set_full_fp32_param(param, weight)
            for key, chunk in optimizer["state"][name].items():
                if self.stage == 3:
                    self._set_zero3(param, chunk.full_tensor(), key)
                else:
                    safe_set_full_optimizer_state(param, chunk.full_tensor(), key)
            self._set_module_weight(param, weight)
        self._set_steps_and_groups(optimizer)
        for key, value in state["engine"].items():
            setattr(self.engine, key, int(value))
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        for key, value in state["engine"].get("loss_scaler", {}).items():
            setattr(scaler, key, value)

    # -- parts -----------------------------------------------------------------------

    def _base(self) -> torch.optim.Optimizer:
        return self.engine.optimizer.optimizer

    def _flat(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """The base optimizer's parameters, each with its group: ZeRO hands it one flat
        fp32 partition per group (ZeRO-3: per sub-group, listed in the group only
        while its step runs)."""
        zero, groups = self.engine.optimizer, self._base().param_groups
        if self.stage == 3:
            return [
                (groups[zero.sub_group_to_group_id[index]], flat)
                for index, flat in enumerate(zero.fp32_partitioned_groups_flat)
            ]
        return [(group, param) for group in groups for param in group["params"]]

    def _init_optimizer_state(self) -> None:
        base = self._base()
        if any(base.state.get(param) for _, param in self._flat()):
            return
        for group, param in self._flat():
            listed, rate, grad = group["params"], group["lr"], param.grad
            group["params"], group["lr"] = [param], 0.0
            if grad is None:
                param.grad = torch.zeros_like(param)
            try:
                base.step()
            finally:
                group["params"], group["lr"], param.grad = listed, rate, grad

    def _link_state(self) -> None:
        """Point each parameter's fragments at the optimizer state (ZeRO-1/2, bf16).
        DeepSpeed links them once, after the first group's first step, when the other
        groups have no state yet (0.19: a parameter of the second group then has no
        ``exp_avg`` fragment); linking again is idempotent."""
        zero = self.engine.optimizer
        link = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)
        if callable(link):
            zero._hp_optimizer_states_linked = False
            link()

    def _state_keys(self) -> list[str]:
        """The base optimizer's per-parameter state tensors (``exp_avg``, ...)."""
        base = self._base()
        states = [base.state[param] for _, param in self._flat() if base.state.get(param)]
        if not states:
            raise UsageError(
                "the DeepSpeed optimizer holds no state yet (torch optimizers create it at "
                "their first step): save after the first step"
            )
        return sorted(
            key
            for key, value in states[0].items()
            if key != "step" and isinstance(value, torch.Tensor) and value.dim() > 0
        )

    def _optimizer(self, moments: dict[str, Any]) -> dict[str, Any]:
        base = self._base()
        steps = []
        for _, param in self._flat():
            step = base.state.get(param, {}).get("step", 0)
            steps.append(float(step.item() if isinstance(step, torch.Tensor) else step))
        groups = [{k: v for k, v in group.items() if k != "params"} for group in base.param_groups]
        return {"state": moments, "steps": steps, "param_groups": groups}

    def _counters(self) -> dict[str, Any]:
        counters: dict[str, Any] = {key: int(getattr(self.engine, key, 0)) for key in _COUNTERS}
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        if scaler is not None and hasattr(scaler, "cur_iter"):  # dynamic (fp16)
            counters["loss_scaler"] = {
                key: getattr(scaler, key) for key in _SCALER if hasattr(scaler, key)
            }
        return counters

    def _shape(self, param: torch.nn.Parameter) -> torch.Size:
        return torch.Size(getattr(param, "ds_shape", param.shape))

    def _mesh_of(self) -> Any:
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(self.group, "cpu")
        return self._mesh

    def _as_dtensor(self, local: torch.Tensor, shape: torch.Size) -> Any:
        from torch.distributed.tensor import DTensor, Shard

        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(
            local, self._mesh_of(), [Shard(0)], run_check=False, shape=shape, stride=stride
        )

    def _chunk(self, full: torch.Tensor | None, shape: torch.Size, where: str) -> Any:
        if full is None:
            raise StateMismatchError(
                f"DeepSpeed holds no fp32 state for {where}: the parameter is not managed "
                "by its ZeRO optimizer",
                mismatched=[where],
            )
        full = full.detach().to("cpu", torch.float32).reshape(shape)
        chunks = full.chunk(self.world, 0) if full.dim() else (full,)
        local = chunks[self.rank] if self.rank < len(chunks) else full[:0]
        return self._as_dtensor(local.clone(), full.shape)

    def _zeros(self, param: torch.nn.Parameter) -> Any:
        shape = self._shape(param)
        full = torch.empty(shape, device="meta")
        chunks = full.chunk(self.world, 0) if full.dim() else (full,)
        local_shape = chunks[self.rank].shape if self.rank < len(chunks) else (0, *shape[1:])
        return self._as_dtensor(torch.zeros(local_shape, dtype=torch.float32), shape)

    def _set_zero3(self, param: torch.nn.Parameter, value: torch.Tensor, key: str | None) -> None:
        """This rank's ZeRO-3 partition of ``param``'s fp32 weight (``key`` None) or
        optimizer state from the whole ``value``. DeepSpeed's own setter
        (``set_full_hp_param``, 0.19) reads past the end of a parameter whose size the
        ranks do not divide (its last partition is padded): the padding stays zero."""
        zero = self.engine.optimizer
        partition, group = zero._get_fp32_opt_state_partition(
            param, release_swap_buffers=False, optim_state_key=key
        )
        flat = value.detach().flatten().to(partition.device, partition.dtype)
        start = partition.numel() * zero._get_param_partition_rank(param)
        count = max(0, min(partition.numel(), flat.numel() - start))
        partition.data[:count].copy_(flat[start : start + count])
        partition.data[count:].zero_()
        if zero._swappable_optimizer_subgroup(group):
            zero._optimizer_states_and_gradient_swap_out(group)

    def _set_module_weight(self, param: torch.nn.Parameter, weight: torch.Tensor) -> None:
        """The module's (low-precision) parameter from the fp32 weight, as a step
        leaves it; ZeRO-3 partitions it again on leaving ``GatheredParameters``."""
        if self.stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if self.rank == 0:
                    param.data.copy_(weight.reshape(param.shape).to(param.dtype))
            return
        param.data.copy_(weight.reshape(param.shape).to(param.dtype))

    def _set_steps_and_groups(self, optimizer: Mapping[str, Any]) -> None:
        base, flat = self._base(), self._flat()
        saved_groups, steps = optimizer["param_groups"], optimizer["steps"]
        if len(set(steps)) == 1:  # as always: one step count, however ZeRO partitions
            steps = steps[:1] * len(flat)
        if len(saved_groups) != len(base.param_groups) or len(steps) != len(flat):
            raise StateMismatchError(
                f"the checkpoint's DeepSpeed optimizer has {len(saved_groups)} parameter "
                f"groups in {len(steps)} partitions, this one {len(base.param_groups)} in "
                f"{len(flat)}: build the optimizer and ZeRO configuration the run was saved with",
                mismatched=["optimizer/param_groups"],
            )
        for group, saved in zip(base.param_groups, saved_groups, strict=True):
            for key, value in saved.items():
                if key == "params" or key not in group:  # hyperparameters the group has
                    continue
                group[key] = tuple(value) if isinstance(group[key], tuple) else value
        for (_, param), step in zip(flat, steps, strict=True):
            state = base.state.get(param)
            if state and "step" in state:
                old = state["step"]
                state["step"] = (
                    torch.full_like(old, step) if isinstance(old, torch.Tensor) else step
                )
