"""Restore templates that say what the saved value must look like.

An engine (FSDP through DCP's state-dict API, DeepSpeed through its fragment setters)
restores through a *template*: containers and tensors laid out as its own state, which
a restore fills in place and the engine then loads. Its loaders take what they are
given: a saved ``lr`` that is a string, a parameter group too many, a counter named
``optimizer`` would fail deep inside torch or DeepSpeed, or set an attribute, after
the restore had applied everything else (the RNGs, the scheduler, the tensors copied
into the template, which FSDP's share with the live model). :class:`Checked` wraps a
template entry with the check its saved value must pass; the restore runs it while it
plans, before anything is applied (:func:`ckptvault.state.apply.plan_restore`), and
refuses the generation, whatever ``strict`` says, when it finds a problem. A template
is filled whole or not at all: a checked entry the checkpoint lacks, and any entry
inside it that is missing or does not fit, refuse the restore too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

__all__ = ["Checked", "layout_problems", "skeleton"]

Check = Callable[[Any], list[str]]


class Checked:
    """A top-level state entry a restore fills in place (``value``), and ``check``:
    the problems of a saved value for it (each "path: what is wrong"), none when it
    fits. Restore only; a save stores ``value``."""

    def __init__(self, value: Any, check: Check) -> None:
        self.value, self.check = value, check

    def __repr__(self) -> str:
        return f"Checked({self.value!r})"


def layout_problems(template: Any, saved: Any, where: str, *, complete: bool) -> list[str]:
    """Where ``saved`` is not laid out as ``template``: a tensor for each tensor; a dict
    for each dict, holding each of its keys (``complete``: every key; otherwise every
    key but those holding tensors, which a restore reports missing itself; keys of its
    own are left to the caller); a list or tuple of the same length for each; a bool
    for a bool, a number (no bool, no tensor) for a number, a str for a str, and any
    such scalar for None."""
    if isinstance(template, torch.Tensor):
        return [] if isinstance(saved, torch.Tensor) else [_wrong(where, saved, "a tensor")]
    if isinstance(template, Mapping):
        if not isinstance(saved, Mapping):
            return [_wrong(where, saved, "a dict")]
        problems = []
        for key, item in template.items():
            path = f"{where}[{key!r}]"
            if key in saved:
                problems += layout_problems(item, saved[key], path, complete=complete)
            elif complete or not isinstance(item, torch.Tensor):
                problems.append(f"{path}: missing from the checkpoint")
        return problems
    if isinstance(template, (list, tuple)):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(template):
            return [_wrong(where, saved, f"a list of {len(template)}")]
        problems = []
        for index, (item, value) in enumerate(zip(template, saved, strict=True)):
            problems += layout_problems(item, value, f"{where}[{index}]", complete=complete)
        return problems
    if _scalar(template) == "none" and _scalar(saved) not in (None, "tensor"):
        return []
    if _scalar(saved) != _scalar(template):
        return [_wrong(where, saved, f"a {_scalar(template) or type(template).__name__}")]
    return []


def skeleton(template: Any) -> Any:
    """``template``'s layout, kept apart from it (a restore fills the template in
    place): its containers copied, each tensor an empty one."""
    if isinstance(template, torch.Tensor):
        return _TENSOR
    if isinstance(template, Mapping):
        return {key: skeleton(item) for key, item in template.items()}
    if isinstance(template, (list, tuple)):
        return type(template)(skeleton(item) for item in template)
    return template


_TENSOR = torch.empty(0)


def _scalar(value: Any) -> str | None:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "str"
    if isinstance(value, torch.Tensor):
        return "tensor"
    return None


def _wrong(where: str, saved: Any, expected: str) -> str:
    shown = f"a list of {len(saved)}" if isinstance(saved, (list, tuple)) else type(saved).__name__
    return f"{where}: the checkpoint holds {shown}, the live state {expected}"


def problems_by_part(
    parts: Iterable[str], state: Mapping[str, Any], check: Callable[[str, Any], list[str]]
) -> list[str]:
    """Every problem of ``state``'s entries ``parts``, each "part: what is wrong"
    (``check(part, saved)`` gives a part's, its paths relative to the part); a part
    ``state`` lacks is missing from the checkpoint."""
    return [
        f"{part}{problem}"
        for part in parts
        for problem in (
            check(part, state[part]) if part in state else [": missing from the checkpoint"]
        )
    ]
