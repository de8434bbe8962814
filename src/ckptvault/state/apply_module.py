"""Planning the restore of a ``torch.nn.Module``: names, shapes, dtypes.

The saved state's keys are matched to the live module's by their plain form
(:func:`ckptvault.state.names.plain_name`, so compiled and plain modules
interchange), after the caller's ``rename`` rules. Every key the plan cannot load is
recorded (missing, unexpected, mismatched shape or type); a tensor of another dtype
is cast as ``load_state_dict`` would and listed in ``RestorePlan.casts``, or refused
under ``strict_dtypes``. A module none of whose keys match is refused even with
``strict=False``: loading its optimizer's moments into untouched weights and calling
that a restore is the half-restore this check exists to prevent.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from ckptvault.state.capture import StatefulPayload
from ckptvault.state.codec import KeyPath, format_path
from ckptvault.state.dtensors import in_live_layout
from ckptvault.state.names import ApplyOptions, plain_name
from ckptvault.state.restore_plan import Action, RestorePlan, unwritable


def _shape(value: Any) -> list[int] | None:
    return list(value.shape) if isinstance(value, torch.Tensor) else None


def _match_keys(
    plan: RestorePlan,
    live: dict[str, Any],
    saved: dict[str, Any],
    path: KeyPath,
    options: ApplyOptions,
) -> tuple[dict[str, Any], list[str]]:
    """Saved values keyed by the live names they land on, and the saved keys that
    land nowhere. Records renames, and two saved keys landing on one live key."""
    live_by_plain: dict[str, str] = {}
    for key in live:
        live_by_plain.setdefault(plain_name(key), key)
    matched: dict[str, Any] = {}
    origin: dict[str, str] = {}
    unmatched = []
    for key, value in saved.items():
        target = plain_name(options.renamed(plain_name(key)))
        if target != plain_name(key):
            plan.renamed.append(f"{format_path((*path, key))} -> {target}")
        live_key = live_by_plain.get(target)
        if live_key is None:
            unmatched.append(key)
        elif live_key in matched:
            plan.mismatched.append(
                f"{format_path((*path, live_key))}: both {origin[live_key]!r} and {key!r} "
                "of the checkpoint map to it"
            )
        else:
            matched[live_key], origin[live_key] = value, key
    return matched, unmatched


def _metadata_for(live: Any, saved: dict[str, Any] | None, options: ApplyOptions) -> Any:
    """The saved per-submodule versions, keyed by the live module's prefixes."""
    live_prefixes = getattr(live, "_metadata", None)
    if saved is None or live_prefixes is None:
        return saved
    by_plain = {}
    for prefix, versions in saved.items():
        plain = plain_name(prefix)
        renamed = options.renamed(plain + ".") if plain else plain
        by_plain[plain_name(renamed.rstrip("."))] = versions
    return {p: by_plain[plain_name(p)] for p in live_prefixes if plain_name(p) in by_plain}


def _check_tensors(
    plan: RestorePlan,
    live: dict[str, Any],
    matched: dict[str, Any],
    path: KeyPath,
    options: ApplyOptions,
) -> set[str]:
    """Record shape, type and dtype problems and casts; returns the keys to drop."""
    drop = set()
    for key, value in matched.items():
        expected, where = live[key], format_path((*path, key))
        if isinstance(expected, torch.Tensor) and not isinstance(value, torch.Tensor):
            plan.mismatched.append(
                f"{where}: checkpoint value of type {type(value).__name__}, the model "
                "expects a tensor"
            )
            drop.add(key)
        elif _shape(value) is not None and _shape(expected) not in (None, _shape(value)):
            plan.mismatched.append(f"{where}: checkpoint {_shape(value)}, model {_shape(expected)}")
            drop.add(key)
        elif isinstance(expected, torch.Tensor) and (refusal := unwritable(expected)):
            plan.mismatched.append(f"{where}: {refusal}")
            drop.add(key)
        elif (
            isinstance(value, torch.Tensor)
            and isinstance(expected, torch.Tensor)
            and value.dtype != expected.dtype
        ):
            cast = f"{where}: {value.dtype} -> {expected.dtype}"
            if options.strict_dtypes:
                plan.mismatched.append(f"{cast} refused (strict_dtypes=True)")
                drop.add(key)
            else:
                plan.casts.append(cast)
        if (
            key not in drop
            and isinstance(expected, torch.Tensor)
            and isinstance(value, torch.Tensor)
        ):
            source = in_live_layout(expected, value)
            if isinstance(source, str):
                plan.mismatched.append(f"{where} {source}")
                drop.add(key)
            else:
                matched[key] = source  # the same key: no insertion while iterating
    return drop


def plan_module(
    plan: RestorePlan,
    module: torch.nn.Module,
    saved: StatefulPayload,
    path: KeyPath,
    options: ApplyOptions,
) -> None:
    where = format_path(path)
    live = module.state_dict()
    matched, unmatched = _match_keys(plan, live, saved.state, path, options)
    if live and saved.state and not matched:
        plan.refused.append(
            f"{where}: none of the checkpoint's {len(saved.state)} keys (such as "
            f"{next(iter(saved.state))!r}) matches one of the module's {len(live)} (such "
            f"as {next(iter(live))!r}); map the names with restore(..., rename=...)"
        )
        return
    missing = [k for k in live if k not in matched]
    plan.missing += [format_path((*path, k)) for k in missing]
    plan.unexpected += [format_path((*path, k)) for k in unmatched]
    drop = _check_tensors(plan, live, matched, path, options)
    loadable: OrderedDict[str, Any] = OrderedDict(
        (k, v) for k, v in matched.items() if k not in drop
    )
    metadata = _metadata_for(live, saved.module_metadata, options)
    if metadata is not None:
        # state_dict() carries per-module versions as an attribute of the dict;
        # load_state_dict reads it back from there. Typeshed's OrderedDict has no slot.
        loadable._metadata = metadata  # type: ignore[attr-defined]
    plan.targets += [
        (value, live[key])
        for key, value in loadable.items()
        if isinstance(value, torch.Tensor) and isinstance(live[key], torch.Tensor)
    ]
    exact = not (missing or unmatched or drop)
    plan.loaded.append(f"{where} ({len(loadable)} of {len(live)} keys)")
    plan.actions.append(Action(where, lambda: module.load_state_dict(loadable, strict=exact)))
