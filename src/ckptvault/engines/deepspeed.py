"""DeepSpeed ZeRO (stages 1, 2 and 3) state, as DeepSpeed's universal checkpoint
holds it, saved as shards every rank writes; nothing pickled.

``engine.save_checkpoint`` writes each rank's flat optimizer partition with
``torch.save`` (pickles, with loss-scaler objects inside), readable only at the same
number of ranks until ``ds_to_universal`` converts it. This module takes the state
the universal form holds, through DeepSpeed's own fragment API
(``deepspeed.utils.safe_get_full_fp32_param`` and friends): for every parameter,
by name, the fp32 master weight and each optimizer state tensor (``exp_avg``,
``exp_avg_sq``), and besides them the optimizer's step and hyperparameters and the
engine's counters. The module's state the optimizer does not hold, its frozen
parameters and persistent buffers (BatchNorm's running statistics), is saved beside
the weights under its ``state_dict`` names, in its own dtype, as data-parallel rank 0
holds it (DeepSpeed's own checkpoint keeps rank 0's module: each rank's statistics
are its own batches'). Each tensor is kept as this rank's ``Shard(0)`` chunk of it (a
DTensor over the data-parallel group; a 0-d buffer replicated), so every rank writes
a share and a restore at another number of ranks reshards; the whole tensor exists
only while one parameter is gathered or set.

Restoring gathers each parameter's chunks back, sets DeepSpeed's partitions with
``safe_set_full_*``, and copies the fp32 weights into the module's parameters
(ZeRO-3: inside ``GatheredParameters``), as a step would have left them, and the
frozen parameters and buffers into the module. What it sets
besides tensors comes from the store: only the engine's own counters (each a count)
and loss-scaler fields, and the hyperparameters its groups have (each of the kind the
group holds), are set; a generation with anything else, or a tensor too many or too
few, is refused while the restore plans, before anything is applied
(:class:`~ckptvault.state.checked.Checked`).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from ckptvault.engines.deepspeed_checks import (
    COUNTERS,
    SCALER,
    counter_problems,
    exact,
    is_count,
)
from ckptvault.errors import StateMismatchError, UsageError
from ckptvault.state.checked import Checked, layout_problems, problems_by_part, skeleton

__all__ = ["DeepSpeedState", "is_deepspeed_engine"]


def is_deepspeed_engine(model: Any) -> bool:
    """Whether ``model`` is a ``deepspeed.DeepSpeedEngine`` (without importing
    DeepSpeed where it is not installed)."""
    return any(kind.__name__ == "DeepSpeedEngine" for kind in type(model).__mro__)


class DeepSpeedState:
    """A ZeRO engine's training state (see the module docstring).

    :meth:`capture` returns ``{"model": ..., "optimizer": ..., "deepspeed": ...}`` (the engine's counters) to
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
        self.extras = _module_extras(engine.module)
        self._mesh: Any = None
        self._template: dict[str, Any] = {}
        self._layout: dict[str, Any] = {}  # the template's, as it was made
        self._fresh = False  # whether template() gave the optimizer its first state

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
        for name, tensor in self.extras:  # in their own dtype: no fp32 copy exists
            weights[name] = self._chunk(self._rank0(tensor), self._shape(tensor), name, None)
        return {
            "model": weights,
            "optimizer": self._optimizer(moments),
            "deepspeed": self._counters(),
        }

    def template(self) -> dict[str, Checked]:
        """The layout :meth:`capture` returns, zero-filled, for a restore to fill. An
        optimizer that has not stepped yet gets its state first, as DCP gives one:
        a step of learning rate 0 on zero gradients (the weights do not move; the
        state it creates is overwritten by the restore). Each entry is
        :class:`~ckptvault.state.checked.Checked`: a restore refuses a generation
        whose entries do not fit this engine (:meth:`problems`) before it applies
        anything, and fills the template whole or not at all."""
        base = self._base()
        self._fresh = not any(base.state.get(param) for _, param in self._flat())
        self._init_optimizer_state()
        self._link_state()
        keys = self._state_keys()
        weights = {name: self._zeros(param) for name, param in self.params}
        weights |= {name: self._zeros(tensor, tensor.dtype) for name, tensor in self.extras}
        moments = {name: {key: self._zeros(param) for key in keys} for name, param in self.params}
        self._template = {
            "model": weights,
            "optimizer": self._optimizer(moments),
            "deepspeed": self._counters(),
        }
        self._layout = skeleton(self._template)
        return {
            part: Checked(value, functools.partial(self._part_problems, part))
            for part, value in self._template.items()
        }

    def discard(self) -> None:
        """The template will not be applied (the restore found nothing, or raised): an
        optimizer that had no state before :meth:`template` gets none again, as it
        was (its zero-step state would shift every later step's bias correction)."""
        if self._fresh:
            base = self._base()
            for _, param in self._flat():
                base.state.pop(param, None)
            if hasattr(self.engine.optimizer, "_hp_optimizer_states_linked"):
                self.engine.optimizer._hp_optimizer_states_linked = False  # at its next step
        self._fresh, self._template, self._layout = False, {}, {}

    def problems(self, state: Mapping[str, Any]) -> list[str]:
        """Why ``state`` (the layout of :meth:`capture`, as a restore filled it) cannot
        be loaded into this engine, each "entry: what is wrong"; none when it can."""
        if not self._template:
            raise UsageError("DeepSpeedState.problems before template: make the template first")
        return problems_by_part(self._template, state, self._part_problems)

    def _part_problems(self, part: str, saved: Any) -> list[str]:
        """The problems of ``saved`` as the template's ``part`` (paths relative to it)."""
        template = self._layout[part]
        if part == "model":
            return exact(template, saved, "")
        if part == "deepspeed":
            return counter_problems(saved)
        problems = exact(template, saved, "", keys_only=True)
        if problems:
            return problems
        problems = exact(template["state"], saved["state"], "['state']")
        return problems + self._step_and_group_problems(saved["steps"], saved["param_groups"])

    def _step_and_group_problems(self, steps: Any, groups: Any) -> list[str]:
        live, flat = self._base().param_groups, self._flat()
        if not isinstance(groups, list) or len(groups) != len(live):
            shown = f"{len(groups)} groups" if isinstance(groups, list) else type(groups).__name__
            return [
                f"['param_groups']: the checkpoint holds {shown}, this optimizer {len(live)} "
                "parameter groups: build the optimizer the run was saved with"
            ]
        problems = []
        for index, (group, saved) in enumerate(zip(live, groups, strict=True)):
            if not isinstance(saved, dict) or not all(type(key) is str for key in saved):
                problems.append(f"['param_groups'][{index}]: not a dict of hyperparameters")
                continue
            for key, value in saved.items():
                if key != "params" and key in group:  # the hyperparameters the group has
                    where = f"['param_groups'][{index}][{key!r}]"
                    problems += layout_problems(group[key], value, where, complete=True)
        if not isinstance(steps, list) or not steps or not all(is_count(s, float) for s in steps):
            problems.append("['steps']: not a list of step counts (numbers from 0 to 2**53)")
        elif len(set(steps)) > 1 and len(steps) != len(flat):
            problems.append(
                f"['steps']: {len(steps)} different step counts for this optimizer's "
                f"{len(flat)} partitions: build the ZeRO configuration the run was saved with"
            )
        return problems

    # -- restoring -----------------------------------------------------------------

    def apply(self, restored: Mapping[str, Any] | None = None) -> None:
        """Load ``restored`` (by default the last :meth:`template`, as a restore
        filled it) into the engine."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        state = self._template if restored is None else restored
        if not self._template:
            raise UsageError("DeepSpeedState.apply before template: restore into the template")
        problems = self.problems(state)
        if problems:  # a restore refused these already; anything else is checked here
            raise StateMismatchError(
                "cannot load into the DeepSpeed engine: "
                + "; ".join(problems[:5])
                + (f"; ... ({len(problems)} in all)" if len(problems) > 5 else "")
                + ". Nothing was loaded: restore a generation saved from this model and "
                "optimizer",
                mismatched=problems,
            )
        optimizer = state["optimizer"]
        for name, param in self.params:
            weight = state["model"][name].full_tensor()
            if self.stage == 3:
                self._set_zero3(param, weight, None)
            else:
                safe_set_full_fp32_param(param, weight)
            for key in self._layout["optimizer"]["state"][name]:
                chunk = optimizer["state"][name][key]
                if self.stage == 3:
                    self._set_zero3(param, chunk.full_tensor(), key)
                else:
                    safe_set_full_optimizer_state(param, chunk.full_tensor(), key)
            self._set_module_weight(param, weight)
        for name, tensor in self.extras:
            self._set_module_weight(tensor, state["model"][name].full_tensor())
        self._set_steps_and_groups(optimizer)
        counters = state["deepspeed"]
        for key in COUNTERS:
            setattr(self.engine, key, counters[key])
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        if scaler is not None and hasattr(scaler, "cur_iter"):  # dynamic (fp16); else none
            for key, value in counters.get("loss_scaler", {}).items():
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
        counters: dict[str, Any] = {key: int(getattr(self.engine, key, 0)) for key in COUNTERS}
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        if scaler is not None and hasattr(scaler, "cur_iter"):  # dynamic (fp16)
            counters["loss_scaler"] = {
                key: getattr(scaler, key) for key in SCALER if hasattr(scaler, key)
            }
        return counters

    def _shape(self, param: torch.Tensor) -> torch.Size:
        return torch.Size(getattr(param, "ds_shape", param.shape))

    def _mesh_of(self) -> Any:
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._mesh = DeviceMesh.from_group(self.group, "cpu")
        return self._mesh

    def _as_dtensor(self, local: torch.Tensor, shape: torch.Size) -> Any:
        """``local`` as this rank's ``Shard(0)`` chunk of a tensor of ``shape`` (a 0-d
        tensor, which has no dim 0: replicated)."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        stride = torch.empty(shape, device="meta").stride()
        placement = Shard(0) if len(shape) else Replicate()
        return DTensor.from_local(
            local, self._mesh_of(), [placement], run_check=False, shape=shape, stride=stride
        )

    def _chunk(
        self,
        full: torch.Tensor | None,
        shape: torch.Size,
        where: str,
        dtype: torch.dtype | None = torch.float32,
    ) -> Any:
        if full is None:
            raise StateMismatchError(
                f"DeepSpeed holds no fp32 state for {where}: the parameter is not managed "
                "by its ZeRO optimizer",
                mismatched=[where],
            )
        full = full.detach().to("cpu", dtype or full.dtype).reshape(shape)
        if not full.dim():  # every rank holds it (see _as_dtensor)
            return self._as_dtensor(full.clone(), full.shape)
        chunks = full.chunk(self.world, 0)
        local = chunks[self.rank] if self.rank < len(chunks) else full[:0]
        return self._as_dtensor(local.clone(), full.shape)

    def _zeros(self, tensor: torch.Tensor, dtype: torch.dtype = torch.float32) -> Any:
        shape = self._shape(tensor)
        full = torch.empty(shape, device="meta")
        chunks = full.chunk(self.world, 0) if full.dim() else (full,) * self.world
        local_shape = chunks[self.rank].shape if self.rank < len(chunks) else (0, *shape[1:])
        return self._as_dtensor(torch.zeros(local_shape, dtype=dtype), shape)

    def _rank0(self, tensor: torch.Tensor) -> torch.Tensor:
        """The whole ``tensor`` (a frozen parameter or a buffer) as data-parallel rank
        0 holds it, on every rank: what DeepSpeed's own checkpoint keeps of the module
        (a buffer such as BatchNorm's running statistics may differ between ranks)."""
        import deepspeed

        with deepspeed.zero.GatheredParameters([tensor], enabled=hasattr(tensor, "ds_id")):
            whole = tensor.detach().to("cpu", copy=True)
        carrier = whole.view(torch.uint8) if whole.dtype == torch.bool else whole
        if self.world > 1:
            source = torch.distributed.get_global_rank(self.group, 0)
            torch.distributed.broadcast(carrier, src=source, group=self.group)
        return whole

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

    def _set_module_weight(self, param: torch.Tensor, weight: torch.Tensor) -> None:
        """The module's (low-precision) parameter from the fp32 weight, as a step
        leaves it, or a frozen parameter or buffer from its saved value; ZeRO-3
        partitions a parameter again on leaving ``GatheredParameters``."""
        if hasattr(param, "ds_id"):  # ZeRO-3's
            import deepspeed

            with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
                if self.rank == 0:
                    param.data.copy_(weight.reshape(param.shape).to(param.dtype))
            return
        param.data.copy_(weight.reshape(param.shape).to(param.dtype))

    def _set_steps_and_groups(self, optimizer: Mapping[str, Any]) -> None:
        """The step counts and hyperparameters (checked by :meth:`problems`)."""
        base, flat = self._base(), self._flat()
        saved_groups, steps = optimizer["param_groups"], optimizer["steps"]
        if len(set(steps)) == 1:  # as always: one step count, however ZeRO partitions
            steps = steps[:1] * len(flat)
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


def _module_extras(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The module's state the optimizer does not hold, by ``state_dict`` name: its
    frozen parameters (``requires_grad=False``) and persistent buffers."""
    frozen = [(name, p) for name, p in module.named_parameters() if not p.requires_grad]
    buffers = [
        (f"{prefix}.{name}" if prefix else name, buffer)
        for prefix, owner in module.named_modules()
        for name, buffer in owner.named_buffers(recurse=False)
        if name not in owner._non_persistent_buffers_set
    ]
    return frozen + buffers
