"""Apply: put a decoded checkpoint back into the caller's live objects, in place.

Restoring happens in two phases so that a mismatch leaves ``state`` untouched:

1. :func:`plan_restore` walks the live state and the decoded checkpoint side by side
   and produces a :class:`RestorePlan` (a list of actions plus every missing,
   unexpected and mis-shaped entry) without changing anything.
2. :meth:`RestorePlan.apply` runs the actions: objects get ``load_state_dict``;
   tensors are copied into in place; dicts and lists keep their identity and get
   their contents replaced; other plain values are replaced in their parent.

Everything that can fail is checked while planning, against the live objects: keys,
shapes, the structure of each object's state (an LR scheduler, GradScaler or other
stateful object loads with ``__dict__.update``-like code, so a key its own
``state_dict()`` does not have would become an attribute: it is refused), and RNG
states, which are first tried on scratch generators. The saved tree itself was
checked when it was decoded (:mod:`ckptvault.state.capture`).

Apply runs in a fixed order, so that what is most likely to fail runs first and what
must come last does: (1) loads into objects and in-place tensor copies, (2) the
contents of plain containers and top-level entries, (3) the RNG-like actions
(``RNGState``, NumPy and torch generators), so that nothing applied after them can
draw random numbers. An exception that still escapes an action is re-raised as a
:class:`StateMismatchError` naming the entry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptvault.errors import CheckpointError, StateMismatchError
from ckptvault.state.capture import (
    GRAD_SCALER,
    LR_SCHEDULER,
    MODULE,
    OPTIMIZER,
    NumpyGeneratorPayload,
    RngPayload,
    StatefulPayload,
    TorchGeneratorPayload,
    is_stateful,
    stateful_kind,
    type_name,
)
from ckptvault.state.codec import KeyPath, format_path, parse_device
from ckptvault.state.rng import RNGState

_MISSING = object()
_PLACEHOLDERS = (StatefulPayload, RngPayload, NumpyGeneratorPayload, TorchGeneratorPayload)


@dataclass(frozen=True)
class Action:
    """One step of applying a plan; ``where`` names the entry it changes."""

    where: str
    run: Callable[[], None]

    def __call__(self) -> None:
        self.run()


@dataclass
class RestorePlan:
    # Run in this order by apply(): loads and tensor copies, then the contents of
    # plain containers, then the RNG-like states.
    actions: list[Callable[[], None]] = field(default_factory=list)
    replacements: list[Callable[[], None]] = field(default_factory=list)
    rng_actions: list[Callable[[], None]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def apply(self, where: str = "the checkpoint") -> None:
        """Run every action, in the order the module docstring gives. Planning checked
        everything it can; whatever still fails here is re-raised as a typed error
        naming the entry (the objects' own code may refuse a value)."""
        for action in (*self.actions, *self.replacements, *self.rng_actions):
            try:
                action()
            except Exception as exc:
                entry = action.where if isinstance(action, Action) else "an entry"
                message = " ".join(str(exc).split())[:500]
                failure = StateMismatchError(
                    f"restoring {where} failed while loading {entry} into the live objects "
                    f"({type(exc).__name__}: {message}); state may be partially restored. "
                    "Rebuild the objects and restore again, or restore with the layout the "
                    "run was saved with.",
                    mismatched=[entry],
                )
                raise failure from exc

    def mismatch_error(self, where: str) -> StateMismatchError:
        parts = []
        for label, items in (
            ("missing from the checkpoint", self.missing),
            ("in the checkpoint but not in state", self.unexpected),
            ("mismatched", self.mismatched),
        ):
            if items:
                shown = ", ".join(items[:20]) + (
                    f", ... ({len(items)} in all)" if len(items) > 20 else ""
                )
                parts.append(f"{label}: {shown}")
        return StateMismatchError(
            f"{where} does not match the objects being restored into; "
            + "; ".join(parts)
            + ". Build the same model/optimizer layout as the saved run, or pass "
            "strict=False to load what matches.",
            missing=self.missing,
            unexpected=self.unexpected,
            mismatched=self.mismatched,
        )


def _shape(value: Any) -> list[int] | None:
    return list(value.shape) if isinstance(value, torch.Tensor) else None


def _holds_live_objects(value: Any) -> bool:
    """Whether a live value is (or contains) something restore must not silently drop."""
    if is_stateful(value) or isinstance(
        value, (torch.Tensor, RNGState, np.random.Generator, torch.Generator)
    ):
        return True
    if isinstance(value, dict):
        return any(_holds_live_objects(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_live_objects(v) for v in value)
    return False


def _contains_placeholder(value: Any) -> bool:
    if isinstance(value, _PLACEHOLDERS):
        return True
    if isinstance(value, dict):
        return any(_contains_placeholder(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_contains_placeholder(v) for v in value)
    return False


class _Planner:
    def __init__(self) -> None:
        self.plan = RestorePlan()

    # Each resolve_* returns the value the parent container should hold afterwards.

    def resolve(self, current: Any, saved: Any, path: KeyPath) -> Any:
        if isinstance(saved, StatefulPayload):
            return self._stateful(current, saved, path)
        if isinstance(saved, RngPayload):
            return self._rng(current, saved, path)
        if isinstance(saved, NumpyGeneratorPayload):
            return self._numpy_generator(current, saved, path)
        if isinstance(saved, TorchGeneratorPayload):
            return self._torch_generator(current, saved, path)
        if is_stateful(current) or isinstance(
            current, (RNGState, np.random.Generator, torch.Generator)
        ):
            self.plan.mismatched.append(
                f"{format_path(path)}: state holds a {type_name(current)}, "
                "the checkpoint a plain value"
            )
            return current
        if isinstance(saved, torch.Tensor):
            return self._tensor(current, saved, path)
        if isinstance(saved, dict) and type(current) in (dict, OrderedDict):
            return self._dict(current, saved, path)
        if isinstance(saved, list) and type(current) is list:
            return self._list(current, saved, path)
        if isinstance(saved, tuple) and type(current) is tuple and len(saved) == len(current):
            return tuple(
                self.resolve(c, s, (*path, i))
                for i, (c, s) in enumerate(zip(current, saved, strict=True))
            )
        if _contains_placeholder(saved):
            self.plan.unexpected.append(
                f"{format_path(path)}: the checkpoint holds objects here that state does not"
            )
            return current
        return saved

    def _dict(self, current: dict[Any, Any], saved: dict[Any, Any], path: KeyPath) -> Any:
        contents = {}
        for key, value in saved.items():
            existing = current.get(key, _MISSING)
            if existing is _MISSING:
                if _contains_placeholder(value):
                    self.plan.unexpected.append(format_path((*path, key)))
                    continue
                contents[key] = value
            else:
                contents[key] = self.resolve(existing, value, (*path, key))
        for key, value in current.items():
            if key not in saved and _holds_live_objects(value):
                self.plan.missing.append(format_path((*path, key)))
                contents[key] = value

        def replace_contents() -> None:
            current.clear()
            current.update(contents)

        self.plan.replacements.append(Action(format_path(path), replace_contents))
        return current

    def _list(self, current: list[Any], saved: list[Any], path: KeyPath) -> Any:
        contents = []
        for index, value in enumerate(saved):
            if index < len(current):
                contents.append(self.resolve(current[index], value, (*path, index)))
            elif _contains_placeholder(value):
                self.plan.unexpected.append(format_path((*path, index)))
            else:
                contents.append(value)
        for index in range(len(saved), len(current)):
            if _holds_live_objects(current[index]):
                self.plan.missing.append(format_path((*path, index)))
                contents.append(current[index])

        def replace_contents() -> None:
            current[:] = contents

        self.plan.replacements.append(Action(format_path(path), replace_contents))
        return current

    def _tensor(self, current: Any, saved: torch.Tensor, path: KeyPath) -> Any:
        if not isinstance(current, torch.Tensor):
            return saved
        if current.shape != saved.shape or current.dtype != saved.dtype:
            self.plan.mismatched.append(
                f"{format_path(path)}: checkpoint {saved.dtype} {list(saved.shape)}, "
                f"state {current.dtype} {list(current.shape)}"
            )
            return current

        def copy_in_place() -> None:
            with torch.no_grad():
                current.copy_(saved)

        self.plan.actions.append(Action(format_path(path), copy_in_place))
        return current

    def _stateful(self, current: Any, saved: StatefulPayload, path: KeyPath) -> Any:
        where = format_path(path)
        if current is _MISSING or not is_stateful(current):
            self.plan.mismatched.append(
                f"{where}: the checkpoint holds a {saved.type_name}, state holds "
                f"{type_name(current) if current is not _MISSING else 'nothing'}"
            )
            return current
        kind = stateful_kind(current)
        if kind != saved.kind:
            self.plan.mismatched.append(
                f"{where}: the checkpoint holds a {saved.kind} ({saved.type_name}), state a "
                f"{kind} ({type_name(current)})"
            )
            return current
        if kind != MODULE and type_name(current) != saved.type_name:
            # Modules are matched by keys and shapes (wrappers change the type); other
            # objects' state only means something to the class that wrote it.
            self.plan.mismatched.append(
                f"{where}: the checkpoint holds a {saved.type_name}, state a {type_name(current)}"
            )
            return current
        if kind == MODULE:
            self._module(current, saved, path)
        elif kind == OPTIMIZER:
            self._optimizer(current, saved, path)
        else:
            self._generic_stateful(current, saved, path)
        return current

    def _module(self, module: torch.nn.Module, saved: StatefulPayload, path: KeyPath) -> None:
        expected = module.state_dict()
        state = saved.state
        missing = [k for k in expected if k not in state]
        unexpected = [k for k in state if k not in expected]
        # A parameter or buffer takes a tensor of its shape (load_state_dict would
        # copy the others first and then fail: refused here, before anything runs).
        not_tensors = [
            k
            for k in state
            if k in expected
            and isinstance(expected[k], torch.Tensor)
            and not isinstance(state[k], torch.Tensor)
        ]
        mismatched = [
            k
            for k in state
            if k in expected
            and _shape(state[k]) is not None
            and _shape(expected[k]) is not None
            and _shape(state[k]) != _shape(expected[k])
        ]
        self.plan.missing += [format_path((*path, k)) for k in missing]
        self.plan.unexpected += [format_path((*path, k)) for k in unexpected]
        self.plan.mismatched += [
            f"{format_path((*path, k))}: checkpoint {_shape(state[k])}, model {_shape(expected[k])}"
            for k in mismatched
        ]
        self.plan.mismatched += [
            f"{format_path((*path, k))}: checkpoint value of type {type(state[k]).__name__}, "
            "the model expects a tensor"
            for k in not_tensors
        ]
        mismatched += not_tensors
        drop = set(unexpected) | set(mismatched)
        loadable: OrderedDict[str, Any] = OrderedDict(
            (k, v) for k, v in state.items() if k not in drop
        )
        if saved.module_metadata is not None:
            # state_dict() carries per-module versions as an attribute of the dict;
            # load_state_dict reads it back from there. Typeshed's OrderedDict has no slot.
            loadable._metadata = saved.module_metadata  # type: ignore[attr-defined]
        exact = not (missing or drop)
        self.plan.actions.append(
            Action(format_path(path), lambda: module.load_state_dict(loadable, strict=exact))
        )

    def _optimizer(
        self, optimizer: torch.optim.Optimizer, saved: StatefulPayload, path: KeyPath
    ) -> None:
        where = format_path(path)
        groups = saved.state.get("param_groups")
        per_param = saved.state.get("state", {})
        if not isinstance(groups, list) or not all(
            isinstance(group, dict)
            and isinstance(group.get("params"), list)
            and all(type(pid) is int for pid in group["params"])
            and all(type(name) is str for name in group)
            for group in groups
        ):
            self.plan.mismatched.append(
                f"{where}: the checkpoint has no param_groups (a list of groups, each "
                "with a list of parameter ids)"
            )
            return
        if not isinstance(per_param, dict) or not all(
            isinstance(entry, dict) for entry in per_param.values()
        ):
            self.plan.mismatched.append(f"{where}.state: not a dict of per-parameter dicts")
            return
        saved_sizes = [len(group["params"]) for group in groups]
        live_sizes = [len(group["params"]) for group in optimizer.param_groups]
        if saved_sizes != live_sizes:
            self.plan.mismatched.append(
                f"{where}.param_groups: checkpoint has groups of {saved_sizes} parameters, "
                f"the optimizer {live_sizes}"
            )
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        saved_ids = [pid for group in groups for pid in group["params"]]
        if len(set(saved_ids)) != len(saved_ids):
            self.plan.mismatched.append(f"{where}.param_groups: a parameter id appears twice")
            return
        by_id = dict(zip(saved_ids, params, strict=True))
        bad = False
        for pid, entry in per_param.items():
            param = by_id.get(pid)
            if param is None:
                self.plan.unexpected.append(format_path((*path, "state", pid)))
                bad = True
                continue
            for name, value in entry.items():
                # Per-element buffers (moments, momentum) have the parameter's shape.
                if (
                    isinstance(value, torch.Tensor)
                    and value.numel() == param.numel()
                    and value.numel() > 1
                    and value.shape != param.shape
                ):
                    self.plan.mismatched.append(
                        f"{format_path((*path, 'state', pid, name))}: checkpoint "
                        f"{list(value.shape)}, parameter {list(param.shape)}"
                    )
                    bad = True
        if not bad:
            self.plan.actions.append(Action(where, lambda: optimizer.load_state_dict(saved.state)))

    def _generic_stateful(self, obj: Any, saved: StatefulPayload, path: KeyPath) -> None:
        """LR schedulers, GradScaler and other stateful objects. Their
        ``load_state_dict`` often amounts to ``self.__dict__.update(state)``: a key the
        object's own ``state_dict()`` does not have would become a new attribute (a
        saved ``"step"`` shadows ``LRScheduler.step``), so such keys are refused.
        Schedulers and scalers have a fixed layout, checked all the way down."""
        where = format_path(path)
        kind = saved.kind
        live = obj.state_dict()
        if not isinstance(live, Mapping):
            self.plan.mismatched.append(
                f"{where}: the live {type_name(obj)}.state_dict() is not a dict"
            )
            return
        if kind == GRAD_SCALER and not live:
            return  # a disabled scaler loads nothing
        foreign = [key for key in saved.state if key not in live]
        self.plan.unexpected += [
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
        if problems:
            self.plan.mismatched += problems
            return
        self.plan.actions.append(Action(where, lambda: obj.load_state_dict(state)))

    def _rng(self, current: Any, saved: RngPayload, path: KeyPath) -> Any:
        if not isinstance(current, RNGState):
            self.plan.mismatched.append(f"{format_path(path)}: the checkpoint holds RNGState")
            return current
        current.check_state_dict(saved.state, format_path(path))
        self.plan.rng_actions.append(
            Action(format_path(path), lambda: current.load_state_dict(saved.state))
        )
        return current

    def _numpy_generator(self, current: Any, saved: NumpyGeneratorPayload, path: KeyPath) -> Any:
        where = format_path(path)
        if not isinstance(current, np.random.Generator):
            self.plan.mismatched.append(f"{where}: the checkpoint holds a numpy Generator")
            return current
        live = current.bit_generator.state.get("bit_generator")
        stored = saved.state.get("bit_generator")
        if live != stored:
            self.plan.mismatched.append(
                f"{where}: checkpoint bit generator {str(stored)[:64]}, state {live}"
            )
            return current
        try:  # on a scratch generator of the same kind: the live one stays untouched
            type(current.bit_generator)().state = saved.state
        except Exception as exc:
            self.plan.mismatched.append(
                f"{where}: the saved {live} state is malformed ({type(exc).__name__})"
            )
            return current

        def set_state() -> None:
            current.bit_generator.state = saved.state

        self.plan.rng_actions.append(Action(where, set_state))
        return current

    def _torch_generator(self, current: Any, saved: TorchGeneratorPayload, path: KeyPath) -> Any:
        where = format_path(path)
        if not isinstance(current, torch.Generator):
            self.plan.mismatched.append(f"{where}: the checkpoint holds a torch.Generator")
            return current
        device = parse_device(saved.device)
        if device is None or device.type != current.device.type:
            self.plan.mismatched.append(
                f"{where}: checkpoint generator on {str(saved.device)[:64]}, "
                f"state on {current.device}"
            )
            return current
        try:  # on a scratch generator of the same device: the live one stays untouched
            torch.Generator(device=current.device).set_state(saved.state)
        except Exception as exc:
            self.plan.mismatched.append(
                f"{where}: the saved generator state is malformed ({type(exc).__name__})"
            )
            return current

        def set_state() -> None:
            current.set_state(saved.state)

        self.plan.rng_actions.append(Action(where, set_state))
        return current


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


def plan_restore(state: MutableMapping[str, Any], saved: dict[str, Any]) -> RestorePlan:
    """Match ``saved`` (decoded) against ``state``; changes nothing. The caller
    decides whether an unclean plan (missing, unexpected, mismatched) is an error."""
    planner = _Planner()
    plan = planner.plan
    for key, value in saved.items():
        if key not in state:
            plan.unexpected.append(format_path((key,)))
            continue
        current = state[key]
        try:
            final = planner.resolve(current, value, (key,))
        except CheckpointError:
            raise
        except Exception as exc:  # a live object's own state_dict(), or a check's bug
            message = " ".join(str(exc).split())[:500]
            raise StateMismatchError(
                f"cannot match the checkpoint's {format_path((key,))} against the live "
                f"object ({type(exc).__name__}: {message}); nothing was restored",
                mismatched=[format_path((key,))],
            ) from exc
        if final is not current:

            def assign(key: str = key, final: Any = final) -> None:
                state[key] = final

            plan.replacements.append(Action(format_path((key,)), assign))
    for key in state:
        if key not in saved:
            plan.missing.append(format_path((key,)))
    return plan
