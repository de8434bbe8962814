"""What changed between two run contracts, sub-field by sub-field, in words.

``ContractMismatch`` should say ``config.lr: 3e-4 → 1e-4``, not only ``config
changed``: the user then knows at once whether the change is the one they meant.
:func:`contract_changes` walks the two encoded contracts (the codec's tagged JSON,
:mod:`ckptvault.state.codec`) in step and lists each leaf that differs, with the
checkpoint's value first. The stored side comes from the store, so everything is
bounded: the depth walked, the number of changes listed, the length of each name
and value shown.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_CHANGES = 20  # listed in a message; the rest are counted
MAX_DEPTH = 16  # below this, a differing sub-tree is shown whole
MAX_SHOWN = 60  # characters of one value or name
ABSENT = "absent"
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
_PAIRS = ("$dict", "$odict")


def contract_changes(saved: Any, current: Any, name: str) -> list[str]:
    """``name.sub: old → new`` for each differing leaf (``saved`` is the checkpoint's)."""
    changes: list[str] = []
    _walk(saved, current, _bounded(name), changes, 0)
    return changes


def _walk(old: Any, new: Any, path: str, changes: list[str], depth: int) -> None:
    if old == new:
        return
    if _digest(old) or _digest(new):
        changes.append(f"{path}: changed (too large to compare field by field: kept as a digest)")
        return
    if depth < MAX_DEPTH:
        old_items, new_items = _children(old), _children(new)
        if old_items is not None and new_items is not None and _same_shape(old, new):
            for key in sorted(set(old_items) | set(new_items), key=str):
                child = _child_path(path, key)
                old_item, new_item = old_items.get(key, _Absent), new_items.get(key, _Absent)
                _walk(old_item, new_item, child, changes, depth + 1)
            return
    changes.append(f"{path}: {_shown(old)} → {_shown(new)}")


class _Absent:
    """A field or key one side does not have."""


ABSENT_VALUE = _Absent  # for a top-level field given on one side only


def _digest(value: Any) -> bool:
    return isinstance(value, dict) and "$blake3" in value and "bytes" in value and len(value) == 2


def _tag(value: Any) -> str | None:
    if isinstance(value, dict) and len(value) == 1:
        (key,) = value
        if isinstance(key, str) and key.startswith("$"):
            return key
    return None


def _same_shape(old: Any, new: Any) -> bool:
    """Walk into both only when they are the same kind of container (a list and a
    tuple differ as wholes; lists of other lengths are shown whole too)."""
    if _tag(old) != _tag(new) or type(old) is not type(new):
        return False
    sequence = _tag(old) == "$tuple" or isinstance(old, list)
    return not sequence or len(_children(old) or {}) == len(_children(new) or {})


def _children(value: Any) -> dict[Any, Any] | None:
    """A container's items by key (index, name, or the repr of a ``$dict`` key)."""
    tag = _tag(value)
    if tag is None and isinstance(value, dict):
        return dict(value)
    if tag is None and isinstance(value, list):
        return dict(enumerate(value))
    if tag == "$tuple" and isinstance(value[tag], list):
        return dict(enumerate(value[tag]))
    if tag in _PAIRS and isinstance(value[tag], list):
        pairs = value[tag]
        if all(isinstance(pair, list) and len(pair) == 2 for pair in pairs):
            return {_Key(_shown(k)): v for k, v in pairs}
    return None


class _Key(str):
    """A ``$dict`` key, shown as ``[its value]``."""


def _child_path(path: str, key: Any) -> str:
    if isinstance(key, (int, _Key)):
        inner = key if isinstance(key, _Key) else str(key)
        return f"{path}[{inner}]"
    text = str(key)
    return f"{path}.{_bounded(text)}" if _IDENTIFIER.match(text) else f"{path}[{_shown(text)}]"


def _shown(value: Any) -> str:
    """A value as a Python user wrote it, bounded: ``3e-4``, ``'ds-v3'``, ``(1, 2)``."""
    return _bounded(_text(value))


def _text(value: Any) -> str:
    if value is _Absent:
        return ABSENT
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, float):
        return _short_float(value)
    if isinstance(value, (int, str)):
        return repr(value)
    tag = _tag(value)
    if tag == "$tuple" and isinstance(value[tag], list):
        items = [_text(v) for v in value[tag]]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if tag == "$float" and isinstance(value[tag], str):
        return f"float({value[tag]!r})"
    if tag is None and isinstance(value, list):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _short_float(value: float) -> str:
    """Below 1e-3 (learning rates, epsilons), the shorter of Python's repr and the
    shortest exact scientific form: ``0.0003`` is ``3e-4``; else the repr (``0.5``)."""
    plain = repr(value)
    if not math.isfinite(value) or value == 0 or abs(value) >= 1e-3:
        return plain
    for digits in range(17):
        mantissa, exponent = f"{value:.{digits}e}".split("e")
        if float(f"{mantissa}e{exponent}") == value:
            scientific = f"{mantissa}e{int(exponent)}"
            return scientific if len(scientific) < len(plain) else plain
    return plain


def _bounded(text: str) -> str:
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."
