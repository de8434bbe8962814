"""Gradients at save time: detecting a save in the middle of gradient accumulation,
and saving the accumulated gradients when asked.

Between ``backward()`` and ``optimizer.step()`` the parameters hold gradients that
are part of the training state (seed 004: the partial gradients, their denominator
and the microbatch cursor). A checkpoint taken there without them cannot resume
exactly. :class:`GradientWatch` notices it: it hooks each optimizer it sees in a
saved or restored state (``register_step_post_hook``) and records the version
counter of every parameter's ``.grad`` after each step. At a later save, a nonzero
gradient whose version moved since the last step was accumulated and not yet
applied. Detection starts once ckptvault has seen the optimizer (the first restore
or save); before its first observed step nothing is reported.

``save(..., include_grads=True)`` saves those gradients under :data:`GRADIENTS`, one
:class:`GradientSlots` per module entry, and restore puts them back in ``.grad``.
The microbatch cursor is the data loader's state (save the loader), the denominator
the user's own value (save it in a plain entry).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator, Mapping, MutableMapping
from typing import Any

import torch

from ckptvault.errors import UsageError
from ckptvault.state.codec_names import KeyPath, format_path

logger = logging.getLogger("ckptvault")

GRADIENTS = "__ckptvault_gradients__"
_NO_GRAD = -1


class GradientSlots:
    """The ``.grad`` of a module's parameters as a stateful object: ``state_dict()``
    maps each parameter name to its gradient (or None), ``load_state_dict`` sets them."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, torch.Tensor | None]:
        return {
            name: param.grad
            for name, param in self.module.named_parameters()
            if param.requires_grad
        }

    def restore_problems(self, state: Mapping[str, Any], path: KeyPath) -> list[str]:
        """What :meth:`load_state_dict` could not set, found before anything is applied
        (the live ``.grad`` is often None, so the planner has no shape to compare): each
        saved gradient must be None or a floating-point tensor of its parameter's shape.
        Names the module lacks are the planner's to report."""
        params = dict(self.module.named_parameters())
        problems = []
        for name, grad in state.items():
            param = params.get(name)
            if param is None or grad is None:
                continue
            if not isinstance(grad, torch.Tensor):
                saved = f"a {type(grad).__name__}"
            elif grad.shape != param.shape or not grad.dtype.is_floating_point:
                saved = f"{list(grad.shape)} {str(grad.dtype).removeprefix('torch.')}"
            else:
                continue
            problems.append(
                f"{format_path((*path, name))}: checkpoint gradient {saved}, parameter "
                f"{list(param.shape)} {str(param.dtype).removeprefix('torch.')}"
            )
        return problems

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        params = dict(self.module.named_parameters())
        for name, grad in state.items():
            param = params[name]
            if grad is None:
                param.grad = None
            elif param.grad is not None and param.grad.shape == grad.shape:
                param.grad.copy_(grad)
            else:  # .grad must live on its parameter's device, in its dtype
                param.grad = grad.detach().to(device=param.device, dtype=param.dtype).clone()


def _top_level(state: Mapping[str, Any], kind: type) -> dict[str, Any]:
    if not isinstance(state, Mapping):
        return {}  # not a state at all: capture says so, with its own error
    return {key: value for key, value in state.items() if isinstance(value, kind)}


class GradientWatch:
    """Which parameters hold gradients accumulated since their optimizer's last step."""

    def __init__(self) -> None:
        # optimizer -> {id(param): grad version after its last step}; weak, so a
        # discarded optimizer is not kept alive by the manager.
        self._after_step: weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, int]] = (
            weakref.WeakKeyDictionary()
        )
        self._hooked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()

    def observe(self, state: Mapping[str, Any]) -> None:
        """Start watching the optimizers among ``state``'s entries."""
        for optimizer in _top_level(state, torch.optim.Optimizer).values():
            if optimizer not in self._hooked:
                self._hooked.add(optimizer)
                optimizer.register_step_post_hook(self._stepped)

    def _stepped(self, optimizer: torch.optim.Optimizer, *_args: Any) -> None:
        self._after_step[optimizer] = {
            id(p): (p.grad._version if p.grad is not None else _NO_GRAD)
            for group in optimizer.param_groups
            for p in group["params"]
        }

    def pending(self, state: Mapping[str, Any]) -> list[str]:
        """Names (``model.fc.weight``) of parameters whose nonzero gradient was
        accumulated after the last observed optimizer step."""
        names = {
            id(param): f"{entry}.{name}"
            for entry, module in _top_level(state, torch.nn.Module).items()
            for name, param in module.named_parameters()
        }
        found = []
        for optimizer in _top_level(state, torch.optim.Optimizer).values():
            versions = self._after_step.get(optimizer)
            if versions is None:
                continue  # no step seen yet: nothing to compare against
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None or versions.get(id(param)) == grad._version:
                        continue
                    if bool(grad.detach().ne(0).any()):
                        found.append(
                            names.get(id(param), f"a parameter of {type(optimizer).__name__}")
                        )
        return found

    def check(self, step: int, state: Mapping[str, Any], include_grads: bool, strict: bool) -> None:
        """Warn (or, ``strict``, raise) when ``state`` holds accumulated gradients that
        the save would drop; with ``include_grads`` they are saved, nothing to say."""
        self.observe(state)
        if include_grads:
            return
        pending = self.pending(state)
        if not pending:
            return
        shown = ", ".join(pending[:5]) + (
            f", ... ({len(pending)} in all)" if len(pending) > 5 else ""
        )
        message = (
            f"the save of step {step} comes between backward() and optimizer.step(): "
            f"{shown} hold gradients accumulated since the last step, which the checkpoint "
            "does not include, so a resume from it is not exact. Save after the "
            "optimizer step, or pass include_grads=True (and save the data loader, which "
            "holds the microbatch cursor)"
        )
        if strict:
            raise UsageError(message + "; strict=True refuses it.")
        logger.warning("%s.", message)


def with_gradients(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` plus :data:`GRADIENTS`: one :class:`GradientSlots` per module entry."""
    if not isinstance(state, Mapping):
        raise UsageError(f"state must be a dict of named entries, not {type(state).__name__}")
    if GRADIENTS in state:
        raise UsageError(f"{GRADIENTS!r} is reserved for include_grads=True; rename that entry")
    slots = {
        key: GradientSlots(module) for key, module in _top_level(state, torch.nn.Module).items()
    }
    return {**state, GRADIENTS: slots}


@contextlib.contextmanager
def gradient_slots(state: MutableMapping[str, Any], saved: Mapping[str, Any]) -> Iterator[None]:
    """While restoring a generation saved with ``include_grads=True``: the live
    :class:`GradientSlots` stand in ``state`` under :data:`GRADIENTS` so that the plan
    matches them like any entry; removed again afterwards, whatever happens."""
    if GRADIENTS not in saved or GRADIENTS in state:
        yield
        return
    state[GRADIENTS] = with_gradients(state)[GRADIENTS]
    try:
        yield
    finally:
        del state[GRADIENTS]
