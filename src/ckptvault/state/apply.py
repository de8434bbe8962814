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
must come last does: (1) loads into optimizers, schedulers and other stateful
objects (their own code may still refuse a value), (2) loads into modules and
in-place tensor copies, (3) the contents of plain containers and top-level entries,
(4) the RNG-like actions (``RNGState``, NumPy and torch generators), so that nothing
applied after them can draw random numbers. Every step but an in-place copy records
how to undo itself (an optimizer's old state tensors, a copy of a small object's
state, a container's old contents, an RNG's old state). An exception that still
escapes a step is re-raised as a :class:`StateMismatchError` naming the entry, after
every step before it is undone: nothing was restored, unless the in-place copies had
begun (only a device fault or a module's own load code can fail there, once planning
has checked shapes, dtypes, layouts and writability), and then the error names them.

This module walks the state tree; the plan and its actions are in
:mod:`ckptvault.state.restore_plan`, the planner of each kind of live object
(module, optimizer, other stateful object, RNG state, generator) in
:mod:`ckptvault.state.apply_objects`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import numpy as np
import torch

from ckptvault.errors import CheckpointError, StateMismatchError
from ckptvault.state.apply_module import plan_module
from ckptvault.state.apply_objects import (
    plan_generic_stateful,
    plan_numpy_generator,
    plan_optimizer,
    plan_rng_state,
    plan_torch_generator,
)
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
from ckptvault.state.checked import Checked
from ckptvault.state.codec import KeyPath, format_path
from ckptvault.state.dtensors import in_live_layout
from ckptvault.state.names import ApplyOptions
from ckptvault.state.param_names import parameter_names
from ckptvault.state.ranks import PerRank
from ckptvault.state.restore_plan import Action, RestorePlan, unwritable
from ckptvault.state.rng import RNGState

__all__ = ["Action", "RestorePlan", "checked_plan", "plan_restore"]

_MISSING = object()
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_PLACEHOLDERS = (StatefulPayload, RngPayload, NumpyGeneratorPayload, TorchGeneratorPayload)


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
    def __init__(self, options: ApplyOptions, names: dict[int, str] | None = None) -> None:
        self.plan = RestorePlan()
        self.options = options
        self.names = names or {}  # id(parameter) -> name, for name-keyed optimizer state

    # Each resolve_* returns the value the parent container should hold afterwards.

    def resolve(self, current: Any, saved: Any, path: KeyPath) -> Any:
        if type(saved) is torch.Tensor and type(current) in _PLAIN_TENSORS:
            # The hot case (one per tensor): a tensor onto a tensor. The checks below
            # would come to the same: a plain tensor is no stateful object or RNG.
            return self._tensor(current, saved, path)
        if isinstance(saved, StatefulPayload):
            return self._stateful(current, saved, path)
        if isinstance(saved, RngPayload):
            return plan_rng_state(self.plan, current, saved, path)
        if isinstance(saved, NumpyGeneratorPayload):
            return plan_numpy_generator(self.plan, current, saved, path)
        if isinstance(saved, TorchGeneratorPayload):
            return plan_torch_generator(self.plan, current, saved, path)
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

        def snapshot() -> Callable[[], None]:
            before = dict(current)

            def undo() -> None:
                current.clear()
                current.update(before)

            return undo

        self.plan.replacements.append(Action(format_path(path), replace_contents, snapshot))
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

        def snapshot() -> Callable[[], None]:
            before = list(current)
            return lambda: current.__setitem__(slice(None), before)

        self.plan.replacements.append(Action(format_path(path), replace_contents, snapshot))
        return current

    def _tensor(self, current: Any, saved: torch.Tensor, path: KeyPath) -> Any:
        if not isinstance(current, torch.Tensor):
            return saved
        where = format_path(path)
        if current.shape != saved.shape:
            self.plan.mismatched.append(
                f"{where}: checkpoint {saved.dtype} {list(saved.shape)}, "
                f"state {current.dtype} {list(current.shape)}"
            )
            return current
        refusal = unwritable(current)
        if refusal is not None:
            self.plan.mismatched.append(f"{where}: {refusal}")
            return current
        if current.dtype != saved.dtype:
            # One rule for every tensor, as load_state_dict: copy_ casts; every cast is
            # listed, and strict_dtypes refuses instead.
            cast = f"{where}: {saved.dtype} -> {current.dtype}"
            if self.options.strict_dtypes:
                self.plan.mismatched.append(f"{cast} refused (strict_dtypes=True)")
                return current
            self.plan.casts.append(cast)
        source = in_live_layout(current, saved)
        if isinstance(source, str):
            self.plan.mismatched.append(f"{where} {source}")
            return current
        self.plan.loaded.append(where)
        self.plan.copy_tensor(where, current, source)
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
            plan_module(self.plan, current, saved, path, self.options)
        elif kind == OPTIMIZER:
            plan_optimizer(self.plan, current, saved, path, self.names)
        else:
            plan_generic_stateful(self.plan, current, saved, path)
        return current


def plan_restore(
    state: MutableMapping[str, Any],
    saved: dict[str, Any],
    left_alone: Iterable[str] = (),
    options: ApplyOptions | None = None,
) -> RestorePlan:
    """Match ``saved`` (decoded) against ``state``; changes nothing. The caller
    decides whether an unclean plan (missing, unexpected, mismatched) is an error;
    a plan with ``refused`` entries is one whatever ``strict`` says. Entries of
    ``state`` named in ``left_alone`` (per-rank entries a new world size cannot
    restore) are not missing: they stay as they are. ``options``: renames and the
    dtype rule (:class:`ckptvault.state.names.ApplyOptions`)."""
    planner = _Planner(options or ApplyOptions(), parameter_names(state))
    plan = planner.plan
    for key, value in saved.items():
        if key not in state:
            if not planner.options.live_entries_only:
                plan.unexpected.append(format_path((key,)))
            continue
        live = state[key]
        current = live.value if isinstance(live, (PerRank, Checked)) else live  # in place
        unclean = (plan.missing, plan.unexpected, plan.mismatched)
        sizes = [len(found) for found in unclean]
        try:
            if isinstance(live, Checked):  # a template, filled whole or refused
                problems = live.check(value)
                if problems:
                    plan.refused += [f"{format_path((key,))}{problem}" for problem in problems]
                    continue
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
        if isinstance(live, Checked):
            for found, size in zip(unclean, sizes, strict=True):
                plan.refused += found[size:]
                del found[size:]
        if final is not current:

            def assign(key: str = key, final: Any = final, live: Any = live) -> None:
                if isinstance(live, (PerRank, Checked)):
                    live.value = final
                else:
                    state[key] = final

            def unassign(key: str = key, current: Any = current, live: Any = live) -> Any:
                return lambda: assign(key, current, live)

            plan.replacements.append(Action(format_path((key,)), assign, unassign))
    skip = set(left_alone)
    for key, live in state.items():
        if key not in saved and key not in skip:
            missing = plan.refused if isinstance(live, Checked) else plan.missing
            missing.append(format_path((key,)))
    return plan


def checked_plan(
    state: MutableMapping[str, Any],
    saved: dict[str, Any],
    left_alone: Iterable[str],
    options: ApplyOptions,
    strict: bool,
    where: str,
) -> RestorePlan:
    """:func:`plan_restore`, raising what makes it unusable: refused entries always,
    anything unclean under ``strict``. Nothing is applied either way."""
    plan = plan_restore(state, saved, left_alone, options)
    if plan.refused:
        raise plan.refusal_error(where)
    if strict and not plan.clean:
        raise plan.mismatch_error(where)
    return plan
