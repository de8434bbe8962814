"""Optimizer state keyed by parameter name, as DCP's ``get_optimizer_state_dict``.

``optimizer.state_dict()`` keys each parameter's state by its position in the
optimizer's groups, so adding, freezing or reordering parameters between save and
restore moves the moments onto the wrong parameters. When the modules of the same
state dict name every parameter of an optimizer, capture keys its state and its
groups' ``params`` by those names (``optim/state/fc2.weight/exp_avg``), and restore
maps them back onto the live optimizer's positions by name: each live group takes
the hyperparameters of the saved group holding its parameters, and a name on one side
only is missing or unexpected. Generations keyed by position still restore as before.

A name is the module's plain parameter name (``fc2.weight``, no ``_orig_mod.``),
prefixed with the state entry and a dot when the state holds more than one module.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckptvault.state.names import plain_name


def parameter_names(state: Mapping[str, Any]) -> dict[int, str]:
    """``id(parameter) -> name`` for the modules among ``state``'s entries (and one
    level of dicts), as capture and restore both compute it from the live state
    (a per-rank entry, wrapped, is no module: its parameters are not named)."""
    modules: list[tuple[str, torch.nn.Module]] = []
    if not isinstance(state, Mapping):
        return {}  # not a state dict: capture refuses it, naming what it is
    for key, value in state.items():
        if isinstance(value, torch.nn.Module):
            modules.append((str(key), value))
        elif isinstance(value, dict):
            modules += [
                (f"{key}.{inner}", nested)
                for inner, nested in value.items()
                if isinstance(nested, torch.nn.Module)
            ]
    names: dict[int, str] = {}
    for entry, module in modules:
        prefix = f"{entry}." if len(modules) > 1 else ""
        for name, param in module.named_parameters(remove_duplicate=True):
            names.setdefault(id(param), prefix + plain_name(name))
    return names


def by_name(
    optimizer: torch.optim.Optimizer, names: Mapping[int, str], saved: Mapping[str, Any]
) -> dict[str, Any] | None:
    """``saved`` (the optimizer's ``state_dict()``) keyed by parameter name, or None
    (keep positions) where a parameter has no name or two share one."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    found = [names.get(id(p)) for p in params]
    if not params or None in found or len(set(found)) != len(found):
        return None
    named = [str(name) for name in found]
    return {
        "state": {named[index]: entry for index, entry in saved["state"].items()},
        "param_groups": [
            {**group, "params": [named[index] for index in group["params"]]}
            for group in saved["param_groups"]
        ],
    }


def is_name_keyed(state: Mapping[str, Any]) -> bool:
    """Whether a saved optimizer state names its parameters (not positions)."""
    groups = state.get("param_groups")
    return (
        isinstance(groups, list)
        and any(isinstance(g, dict) and g.get("params") for g in groups)
        and all(
            isinstance(g, dict)
            and isinstance(g.get("params"), list)
            and all(type(p) is str for p in g["params"])
            for g in groups
        )
    )


class NamedState:
    """A name-keyed saved optimizer state mapped onto a live optimizer's positions:
    ``loadable`` for ``load_state_dict``, and the names on one side only."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, saved: Mapping[str, Any], names: Mapping[int, str]
    ) -> None:
        self.missing: list[str] = []  # live parameters the checkpoint has no group for
        self.unexpected: list[str] = []  # saved parameters the optimizer does not hold
        self.problem: str | None = None
        groups, per_param = saved["param_groups"], saved.get("state", {})
        self.loadable: dict[str, Any] = {"state": {}, "param_groups": []}
        group_of = {name: index for index, g in enumerate(groups) for name in g["params"]}
        live_names: set[str] = set()
        position = 0
        for live_group in optimizer.param_groups:
            positions, chosen = [], None
            for param in live_group["params"]:
                name = names.get(id(param))
                if name is None:
                    self.problem = "a parameter of the optimizer belongs to no module in state"
                    return
                live_names.add(name)
                positions.append(position)
                if name in group_of:
                    chosen = group_of[name] if chosen is None else chosen
                    if name in per_param:
                        self.loadable["state"][position] = per_param[name]
                else:
                    self.missing.append(name)
                position += 1
            # The hyperparameters of the saved group that holds this group's parameters
            # (the live group's own where none of them was saved).
            source = groups[chosen] if chosen is not None else live_group
            hyper = {k: v for k, v in source.items() if k != "params"}
            self.loadable["param_groups"].append({**hyper, "params": positions})
        # Saved state of a parameter no group holds is unexpected too, never dropped.
        self.unexpected = sorted((set(group_of) | set(per_param)) - live_names)
