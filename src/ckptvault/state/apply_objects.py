"""Planning the restore of one live object, kind by kind.

Optimizers, other stateful objects (LR schedulers, GradScaler, anything
with ``state_dict``/``load_state_dict``), ``RNGState`` and NumPy and torch
generators each have their own planner here (modules in
:mod:`ckptvault.state.apply_module`). A planner checks the saved state
against the live object without changing it, records every problem in the
:class:`~ckptvault.state.restore_plan.RestorePlan`, and adds the action that loads
the state only when nothing was wrong. :mod:`ckptvault.state.apply` walks the state
tree and calls them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ckptvault.state.capture import (
    GRAD_SCALER,
    LR_SCHEDULER,
    NumpyGeneratorPayload,
    RngPayload,
    StatefulPayload,
    TorchGeneratorPayload,
    type_name,
)
from ckptvault.state.codec import KeyPath, format_path, parse_device
from ckptvault.state.dtensors import in_live_layout, is_dtensor
from ckptvault.state.gradients import GradientSlots
from ckptvault.state.param_names import NamedState, is_name_keyed
from ckptvault.state.restore_plan import Action, RestorePlan
from ckptvault.state.rng import RNGState


def _shape(value: Any) -> list[int] | None:
    return list(value.shape) if isinstance(value, torch.Tensor) else None


# -- stateful objects ----------------------------------------------------------------


def plan_optimizer(
    plan: RestorePlan,
    optimizer: torch.optim.Optimizer,
    saved: StatefulPayload,
    path: KeyPath,
    names: Mapping[int, str],
) -> None:
    where = format_path(path)
    state: dict[str, Any] | None = saved.state
    if is_name_keyed(saved.state):  # by parameter name: onto the live positions by name
        state = _by_live_position(plan, optimizer, saved.state, names, path)
    if state is None:
        return
    groups: Any = state.get("param_groups")  # checked below, before it is used
    per_param = state.get("state", {})
    problem = _optimizer_layout_problem(groups, per_param, optimizer, where)
    if problem is not None:
        plan.mismatched.append(problem)
        return
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_ids = [pid for group in groups for pid in group["params"]]
    if len(set(saved_ids)) != len(saved_ids):
        plan.mismatched.append(f"{where}.param_groups: a parameter id appears twice")
        return
    by_id = dict(zip(saved_ids, params, strict=True))
    if not _per_param_state_fits(plan, per_param, by_id, path):
        return
    loadable = _in_params_layout(plan, state, by_id, path)
    if loadable is not None:
        plan.targets += _state_slots(optimizer, loadable, by_id)
        plan.loaded.append(where)
        plan.object_loads.append(
            Action(
                where,
                lambda: optimizer.load_state_dict(loadable),
                # Loading gives the optimizer new state tensors: the old ones stay as
                # they were, so their state_dict() (references, no copy) undoes it.
                snapshot=lambda: _loader(optimizer, optimizer.state_dict()),
            )
        )


def _state_slots(
    optimizer: torch.optim.Optimizer, loadable: dict[str, Any], by_id: dict[int, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(saved, live) for each saved state tensor whose slot the optimizer already
    fills with a tensor: loading it makes the saved tensor that slot's value."""
    slots = []
    for pid, entry in loadable.get("state", {}).items():
        current = optimizer.state.get(by_id[pid], {})
        for name, value in entry.items():
            live = current.get(name) if isinstance(current, dict) else None
            if isinstance(value, torch.Tensor) and isinstance(live, torch.Tensor):
                slots.append((value, live))
    return slots


def _by_live_position(
    plan: RestorePlan,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
    names: Mapping[int, str],
    path: KeyPath,
) -> dict[str, Any] | None:
    """A name-keyed saved state as ``load_state_dict`` takes it for this optimizer
    (:class:`ckptvault.state.param_names.NamedState`); names on one side only are
    recorded missing or unexpected, as a module's keys are."""
    per_param = state.get("state", {})
    if not isinstance(per_param, dict) or not all(
        type(name) is str and isinstance(entry, dict) for name, entry in per_param.items()
    ):
        plan.mismatched.append(f"{format_path(path)}.state: not a dict of per-parameter dicts")
        return None
    named = NamedState(optimizer, state, names)
    if named.problem is not None:
        plan.mismatched.append(f"{format_path(path)}: {named.problem}")
        return None
    plan.missing += [format_path((*path, "state", name)) for name in named.missing]
    plan.unexpected += [format_path((*path, "state", name)) for name in named.unexpected]
    return named.loadable


def _in_params_layout(
    plan: RestorePlan, state: dict[str, Any], by_id: dict[int, torch.Tensor], path: KeyPath
) -> dict[str, Any] | None:
    """The optimizer's saved state with each per-element buffer in its parameter's
    layout (a DTensor parameter on a one-rank mesh: :mod:`ckptvault.state.dtensors`),
    or None, with the entries recorded, where one cannot be."""
    if not any(is_dtensor(param) for param in by_id.values()):
        return state
    per_param: dict[Any, dict[str, Any]] = {}
    for pid, entry in state.get("state", {}).items():
        param, converted = by_id[pid], {}
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.shape == param.shape and value.dim():
                value = in_live_layout(param, value)
                if isinstance(value, str):
                    plan.mismatched.append(f"{format_path((*path, 'state', pid, name))} {value}")
                    return None
            converted[name] = value
        per_param[pid] = converted
    return {**state, "state": per_param}


def _optimizer_layout_problem(
    groups: Any, per_param: Any, optimizer: torch.optim.Optimizer, where: str
) -> str | None:
    """Why the saved param_groups and per-parameter state do not fit the optimizer's
    groups, or None when they do."""
    if not isinstance(groups, list) or not all(
        isinstance(group, dict)
        and isinstance(group.get("params"), list)
        and all(type(pid) is int for pid in group["params"])
        and all(type(name) is str for name in group)
        for group in groups
    ):
        return (
            f"{where}: the checkpoint has no param_groups (a list of groups, each "
            "with a list of parameter ids)"
        )
    if not isinstance(per_param, dict) or not all(
        isinstance(entry, dict) for entry in per_param.values()
    ):
        return f"{where}.state: not a dict of per-parameter dicts"
    saved_sizes = [len(group["params"]) for group in groups]
    live_sizes = [len(group["params"]) for group in optimizer.param_groups]
    if saved_sizes != live_sizes:
        return (
            f"{where}.param_groups: checkpoint has groups of {saved_sizes} parameters, "
            f"the optimizer {live_sizes}"
        )
    return None


def _per_param_state_fits(
    plan: RestorePlan,
    per_param: dict[Any, dict[str, Any]],
    by_id: dict[int, torch.Tensor],
    path: KeyPath,
) -> bool:
    """Whether every saved per-parameter entry belongs to a parameter and its
    per-element buffers have that parameter's shape; records each that does not."""
    fits = True
    for pid, entry in per_param.items():
        param = by_id.get(pid)
        if param is None:
            plan.unexpected.append(format_path((*path, "state", pid)))
            fits = False
            continue
        for name, value in entry.items():
            # Per-element buffers (moments, momentum) have the parameter's shape.
            if (
                isinstance(value, torch.Tensor)
                and value.numel() == param.numel()
                and value.numel() > 1
                and value.shape != param.shape
            ):
                plan.mismatched.append(
                    f"{format_path((*path, 'state', pid, name))}: checkpoint "
                    f"{list(value.shape)}, parameter {list(param.shape)}"
                )
                fits = False
    return fits


def plan_generic_stateful(
    plan: RestorePlan, obj: Any, saved: StatefulPayload, path: KeyPath
) -> None:
    """LR schedulers, GradScaler and other stateful objects. Their
    ``load_state_dict`` often amounts to ``self.__dict__.update(state)``: a key the
    object's own ``state_dict()`` does not have would become a new attribute (a
    saved ``"step"`` shadows ``LRScheduler.step``), so such keys are refused.
    Schedulers and scalers have a fixed layout, checked all the way down."""
    where = format_path(path)
    kind = saved.kind
    live = obj.state_dict()
    if not isinstance(live, Mapping):
        plan.mismatched.append(f"{where}: the live {type_name(obj)}.state_dict() is not a dict")
        return
    if kind == GRAD_SCALER and not live:
        return  # a disabled scaler loads nothing
    foreign = [key for key in saved.state if key not in live]
    plan.unexpected += [
        f"{format_path((*path, key))}: not in the live {type_name(obj)}'s state_dict()"
        for key in foreign
    ]
    state = {key: value for key, value in saved.state.items() if key in live}
    problems: list[str] = []
    if kind in (LR_SCHEDULER, GRAD_SCALER):
        for key, value in state.items():
            problems += _layout_problems(live[key], value, format_path((*path, key)))
    if kind == GRAD_SCALER:
        problems += [
            f"{format_path((*path, key))}: missing from the checkpoint"
            for key in live
            if key not in state
        ]
    if isinstance(obj, GradientSlots):  # include_grads=True: shapes the live None hides
        problems += obj.restore_problems(state, path)
    if problems:
        plan.mismatched += problems
        return
    plan.loaded.append(where)
    plan.object_loads.append(
        Action(
            where,
            lambda: obj.load_state_dict(state),
            # A copy: such an object may keep what it is given and change it in place.
            snapshot=lambda: _loader(obj, copy.deepcopy(obj.state_dict())),
        )
    )


def _loader(obj: Any, state: Any) -> Callable[[], None]:
    """What loads ``state`` back into ``obj``: the undo of a load."""
    return lambda: obj.load_state_dict(state)


def _layout_problems(live: Any, saved: Any, where: str) -> list[str]:
    """Where ``saved`` does not have the layout of ``live`` (a fixed-layout object's
    state): dicts with string keys are attribute sets (no new keys, checked all the
    way down); other dicts are data (any keys); lists keep their length; a container
    never stands where the live object has a scalar; None only where it has None."""
    if isinstance(live, Mapping):
        if not isinstance(saved, Mapping):
            return [f"{where}: checkpoint {type(saved).__name__}, live object a dict"]
        if not all(type(key) is str for key in live):
            return []
        problems = [f"{where}[{key!r}]: not in the live object" for key in saved if key not in live]
        for key, value in saved.items():
            if key in live:
                problems += _layout_problems(live[key], value, f"{where}[{key!r}]")
        return problems
    if isinstance(live, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            shown = f"{len(saved)} items" if isinstance(saved, (list, tuple)) else "no list"
            return [f"{where}: checkpoint has {shown}, live object {len(live)} items"]
        problems = []
        for index, (live_item, saved_item) in enumerate(zip(live, saved, strict=True)):
            problems += _layout_problems(live_item, saved_item, f"{where}[{index}]")
        return problems
    if isinstance(saved, (Mapping, list, tuple)):
        return [f"{where}: checkpoint {type(saved).__name__}, live object {type(live).__name__}"]
    if live is None or _scalar_kind(live) == _scalar_kind(saved):
        return []
    return [f"{where}: checkpoint {type(saved).__name__}, live object {type(live).__name__}"]


def _scalar_kind(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, (bool, int, float, np.number, np.bool_, torch.Tensor)):
        return "number"  # ints, floats and (0-d) tensors stand for one another
    return type(value).__name__


# -- RNG states and generators: applied last (see ckptvault.state.apply) --------------


def plan_rng_state(plan: RestorePlan, current: Any, saved: RngPayload, path: KeyPath) -> Any:
    if not isinstance(current, RNGState):
        plan.mismatched.append(f"{format_path(path)}: the checkpoint holds RNGState")
        return current
    current.check_state_dict(saved.state, format_path(path))
    plan.loaded.append(format_path(path))
    plan.rng_actions.append(
        Action(
            format_path(path),
            lambda: current.load_state_dict(saved.state),
            snapshot=lambda: _loader(current, current.state_dict()),
        )
    )
    return current


def plan_numpy_generator(
    plan: RestorePlan, current: Any, saved: NumpyGeneratorPayload, path: KeyPath
) -> Any:
    where = format_path(path)
    if not isinstance(current, np.random.Generator):
        plan.mismatched.append(f"{where}: the checkpoint holds a numpy Generator")
        return current
    live = current.bit_generator.state.get("bit_generator")
    stored = saved.state.get("bit_generator")
    if live != stored:
        plan.mismatched.append(
            f"{where}: checkpoint bit generator {str(stored)[:64]}, state {live}"
        )
        return current
    try:  # on a scratch generator of the same kind: the live one stays untouched
        type(current.bit_generator)().state = saved.state
    except Exception as exc:
        plan.mismatched.append(
            f"{where}: the saved {live} state is malformed ({type(exc).__name__})"
        )
        return current

    def set_state() -> None:
        current.bit_generator.state = saved.state

    def snapshot() -> Callable[[], None]:
        before = current.bit_generator.state
        return lambda: setattr(current.bit_generator, "state", before)

    plan.loaded.append(where)
    plan.rng_actions.append(Action(where, set_state, snapshot))
    return current


def plan_torch_generator(
    plan: RestorePlan, current: Any, saved: TorchGeneratorPayload, path: KeyPath
) -> Any:
    where = format_path(path)
    if not isinstance(current, torch.Generator):
        plan.mismatched.append(f"{where}: the checkpoint holds a torch.Generator")
        return current
    device = parse_device(saved.device)
    if device is None or device.type != current.device.type:
        plan.mismatched.append(
            f"{where}: checkpoint generator on {str(saved.device)[:64]}, state on {current.device}"
        )
        return current
    try:  # on a scratch generator of the same device: the live one stays untouched
        torch.Generator(device=current.device).set_state(saved.state)
    except Exception as exc:
        plan.mismatched.append(
            f"{where}: the saved generator state is malformed ({type(exc).__name__})"
        )
        return current

    def set_state() -> None:
        current.set_state(saved.state)

    def snapshot() -> Callable[[], None]:
        before = current.get_state()

        def undo() -> None:
            current.set_state(before)

        return undo

    plan.loaded.append(where)
    plan.rng_actions.append(Action(where, set_state, snapshot))
    return current
