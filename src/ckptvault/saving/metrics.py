"""Metrics a save records (``save(step, state, metrics={"val_loss": 0.3})``).

They go into the manifest's optional ``metrics`` section, so the self-digest and the
signature cover them; retention's ``keep_best`` reads them back through the same
bounded structure checks a restore applies (never more than the checks read; see
:class:`~ckptvault.retention.collector.GarbageCollector`).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from ckptvault.errors import FormatError, UsageError
from ckptvault.format.manifest import check_metrics


def validate_metrics(metrics: Mapping[str, Any] | None) -> dict[str, int | float] | None:
    """Plain numbers by name, ready for the manifest; ``UsageError`` for anything else.

    NumPy scalars are accepted (``float(x)``); tensors are not: pass ``loss.item()``.
    ``None`` or an empty mapping records nothing.
    """
    if not metrics:
        return None
    if not isinstance(metrics, Mapping):
        raise UsageError(f"metrics must be a mapping of name -> number, got {type(metrics)!r}")
    plain: dict[Any, Any] = {}
    for name, value in metrics.items():
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            plain[name] = int(value)
        elif isinstance(value, numbers.Real) and not isinstance(value, bool):
            plain[name] = float(value)
        else:
            hint = " (call .item() on a tensor)" if hasattr(value, "item") else ""
            raise UsageError(
                f"metrics[{name!r}] must be a plain number, got {type(value).__name__}{hint}"
            )
    try:
        return check_metrics(plain, "save(metrics=...)")
    except FormatError as exc:
        raise UsageError(str(exc)) from exc
