"""Apply: put a decoded checkpoint back into the caller's live objects, in place.

Restoring happens in two phases so that a mismatch leaves ``state`` untouched:

1. :func:`plan_restore` walks the live state and the decoded checkpoint side by side
   and produces a :class:`RestorePlan` (a list of actions plus every missing,
   unexpected and mis-shaped entry) without changing anything.
2. :meth:`RestorePlan.apply` runs the actions: objects get ``load_state_dict``;
   tensors are copied into in place; dicts and lists keep their identity and get
   their contents replaced; other plain values are replaced in their parent. The
   RNG-like actions (``RNGState``, NumPy and torch generators) run last.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptvault.errors import StateMismatchError
from ckptvault.state.capture import (
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
from ckptvault.state.codec import KeyPath, format_path
from ckptvault.state.rng import RNGState

_MISSING = object()
_PLACEHOLDERS = (StatefulPayload, RngPayload, NumpyGeneratorPayload, TorchGeneratorPayload)


@dataclass
class RestorePlan:
    actions: list[Callable[[], None]] = field(default_factory=list)
    rng_actions: list[Callable[[], None]] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return not (self.missing or self.unexpected or self.mismatched)

    def apply(self, where: str = "the checkpoint") -> None:
        """Run every action; a failure here (rare: checks come first) is typed."""
        try:
            for action in self.actions:
                action()
            for action in self.rng_actions:
                action()
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise StateMismatchError(
                f"restoring {where} failed while loading into the live objects "
                f"({type(exc).__name__}: {exc}); state may be partially restored. Rebuild the "
                "objects and restore again, or restore with the layout the run was saved with."
            ) from exc

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

        self.plan.actions.append(replace_contents)
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

        self.plan.actions.append(replace_contents)
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

        self.plan.actions.append(copy_in_place)
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
        drop = set(unexpected) | set(mismatched)
        loadable: OrderedDict[str, Any] = OrderedDict(
            (k, v) for k, v in state.items() if k not in drop
        )
        if saved.module_metadata is not None:
            # state_dict() carries per-module versions as an attribute of the dict;
            # load_state_dict reads it back from there. Typeshed's OrderedDict has no slot.
            loadable._metadata = saved.module_metadata  # type: ignore[attr-defined]
        exact = not (missing or drop)
        self.plan.actions.append(lambda: module.load_state_dict(loadable, strict=exact))

    def _optimizer(
        self, optimizer: torch.optim.Optimizer, saved: StatefulPayload, path: KeyPath
    ) -> None:
        where = format_path(path)
        groups = saved.state.get("param_groups")
        if not isinstance(groups, list):
            self.plan.mismatched.append(f"{where}: the checkpoint has no param_groups")
            return
        saved_sizes = [len(group.get("params", [])) for group in groups]
        live_sizes = [len(group["params"]) for group in optimizer.param_groups]
        if saved_sizes != live_sizes:
            self.plan.mismatched.append(
                f"{where}.param_groups: checkpoint has groups of {saved_sizes} parameters, "
                f"the optimizer {live_sizes}"
            )
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        saved_ids = [pid for group in groups for pid in group["params"]]
        by_id = dict(zip(saved_ids, params, strict=True))
        bad = False
        for pid, entry in saved.state.get("state", {}).items():
            param = by_id.get(pid)
            if param is None:
                self.plan.unexpected.append(format_path((*path, "state", pid)))
                bad = True
                continue
            for name, value in entry.items() if isinstance(entry, dict) else ():
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
            self.plan.actions.append(lambda: optimizer.load_state_dict(saved.state))

    def _generic_stateful(self, obj: Any, saved: StatefulPayload, path: KeyPath) -> None:
        self.plan.actions.append(lambda: obj.load_state_dict(saved.state))

    def _rng(self, current: Any, saved: RngPayload, path: KeyPath) -> Any:
        if not isinstance(current, RNGState):
            self.plan.mismatched.append(f"{format_path(path)}: the checkpoint holds RNGState")
            return current
        current.check_state_dict(saved.state, format_path(path))
        self.plan.rng_actions.append(lambda: current.load_state_dict(saved.state))
        return current

    def _numpy_generator(self, current: Any, saved: NumpyGeneratorPayload, path: KeyPath) -> Any:
        where = format_path(path)
        if not isinstance(current, np.random.Generator):
            self.plan.mismatched.append(f"{where}: the checkpoint holds a numpy Generator")
            return current
        live = current.bit_generator.state.get("bit_generator")
        stored = saved.state.get("bit_generator")
        if live != stored:
            self.plan.mismatched.append(f"{where}: checkpoint bit generator {stored}, state {live}")
            return current

        def set_state() -> None:
            current.bit_generator.state = saved.state

        self.plan.rng_actions.append(set_state)
        return current

    def _torch_generator(self, current: Any, saved: TorchGeneratorPayload, path: KeyPath) -> Any:
        where = format_path(path)
        if not isinstance(current, torch.Generator):
            self.plan.mismatched.append(f"{where}: the checkpoint holds a torch.Generator")
            return current
        if torch.device(saved.device).type != current.device.type:
            self.plan.mismatched.append(
                f"{where}: checkpoint generator on {saved.device}, state on {current.device}"
            )
            return current

        def set_state() -> None:
            current.set_state(saved.state)

        self.plan.rng_actions.append(set_state)
        return current


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
        final = planner.resolve(current, value, (key,))
        if final is not current:

            def assign(key: str = key, final: Any = final) -> None:
                state[key] = final

            plan.actions.append(assign)
    for key in state:
        if key not in saved:
            plan.missing.append(format_path((key,)))
    return plan
