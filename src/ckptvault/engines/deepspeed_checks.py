"""Checks of a DeepSpeed generation's non-tensor parts before anything is applied.

Whoever writes an unsigned store can edit them: each counter becomes an attribute of
the engine, each hyperparameter a value of a live parameter group. So a generation
must hold exactly the template's layout (:func:`exact`), its counters plain counts
(:func:`counter_problems`); :class:`~ckptvault.engines.deepspeed.DeepSpeedState`
refuses one that does not, while planning, with every problem named.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ckptvault.state.checked import layout_problems

__all__ = ["COUNTERS", "SCALER", "counter_problems", "exact", "is_count"]

# The engine's counters a resumed run continues from (lr schedules and gradient
# accumulation boundaries follow them).
COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
# A dynamic loss scaler's state (fp16), when the optimizer has one.
SCALER = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


# The largest counter a generation may set: DeepSpeed and torch keep them in int64.
_MAX_COUNT = 2**63 - 1


def is_count(value: Any, kind: type = int) -> bool:
    """Whether ``value`` is a count: an ``int`` (``kind`` float: or a whole float, as
    a torch optimizer's step is), from 0 to the largest int64 (float: 2**53)."""
    if type(value) is int:
        return 0 <= value <= (_MAX_COUNT if kind is int else 2**53)
    return kind is float and type(value) is float and value.is_integer() and 0 <= value <= 2**53


def exact(
    template: Mapping[str, Any], saved: Any, where: str, keys_only: bool = False
) -> list[str]:
    """``saved`` has ``template``'s layout (:func:`layout_problems`) and no key of its
    own (a template is filled whole: every key of it, none besides); ``keys_only``:
    its top-level keys alone."""
    if not isinstance(saved, Mapping):
        return [f"{where}: the checkpoint holds {type(saved).__name__}, the engine a dict"]
    extra = [
        f"{where}[{key!r}]: not in this engine's state" for key in saved if key not in template
    ]
    if keys_only:
        missing = [
            f"{where}[{key!r}]: missing from the checkpoint" for key in template if key not in saved
        ]
        return extra + missing
    problems = extra + layout_problems(template, saved, where, complete=True)
    for key, item in template.items():
        if isinstance(item, Mapping) and isinstance(saved.get(key), Mapping):
            problems += [
                f"{where}[{key!r}][{inner!r}]: not in this engine's state"
                for inner in saved[key]
                if inner not in item
            ]
    return problems


def counter_problems(saved: Any) -> list[str]:
    """The engine's counters: each of :data:`COUNTERS` a count, and a dynamic loss
    scaler's numbers; nothing else (each key becomes an attribute of the engine)."""
    if not isinstance(saved, Mapping):
        return [f": the checkpoint holds {type(saved).__name__}, the engine a dict of counters"]
    problems = [
        f"[{key!r}]: not a counter of a DeepSpeed engine"
        for key in saved
        if key not in (*COUNTERS, "loss_scaler")
    ]
    problems += [
        f"[{key!r}]: {'missing' if key not in saved else repr(saved[key])[:40]}, not a count "
        "from 0 to 2**63 - 1"
        for key in COUNTERS
        if not is_count(saved.get(key))
    ]
    scaler = saved.get("loss_scaler", {})
    if not isinstance(scaler, Mapping):
        return [*problems, "['loss_scaler']: not a dict of the loss scaler's state"]
    for key, value in scaler.items():
        where = f"['loss_scaler'][{key!r}]"
        if key not in SCALER:
            problems.append(f"{where}: not part of a DeepSpeed loss scaler's state")
        elif key == "cur_scale":
            number = type(value) in (int, float) and math.isfinite(value) and value > 0
            problems += [] if number else [f"{where}: {value!r:.40}, not a finite scale > 0"]
        elif not (type(value) is int and -_MAX_COUNT <= value <= _MAX_COUNT):
            problems.append(f"{where}: {value!r:.40}, not an int64")
    return problems
