"""Metrics a save records (``save(step, state, metrics={"val_loss": 0.3})``).

They go into the manifest's optional ``metrics`` section, so the self-digest and the
signature cover them; retention's ``keep_best`` reads them back through the same
bounded structure checks a restore applies (never more than the checks read).
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

from ckptvault.errors import CheckpointError, FormatError, UsageError
from ckptvault.format.manifest import check_metrics
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.checks import TrustPolicy, check_structure
from ckptvault.trust.problems import GenerationRejected


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


def read_metrics(store: Store, ref: GenerationRef, policy: TrustPolicy) -> dict[str, float] | None:
    """The metrics a generation recorded, or None (none recorded, or the generation
    fails the structure checks: what a bad generation claims is not believed)."""
    try:
        manifest = check_structure(store, ref, policy).manifest
    except (GenerationRejected, CheckpointError, OSError):
        return None
    return dict(manifest.metrics) if manifest.metrics else None
