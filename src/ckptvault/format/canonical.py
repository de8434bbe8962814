"""Canonical JSON: one byte string per value, so that exact bytes can be signed.

The form is UTF-8, keys sorted, no insignificant whitespace, no NaN/Infinity
literals (the state codec tags those before they get here). ``loads_canonical``
refuses input that is not already in canonical form, so two readers can never
disagree about what a manifest says.
"""

from __future__ import annotations

import json
from typing import Any

from ckptvault.errors import FormatError


def dumps_canonical(value: Any) -> bytes:
    """Serialize ``value`` to canonical JSON bytes."""
    try:
        text = json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except ValueError as exc:  # NaN/inf slipped through: a bug in the caller
        raise FormatError(f"value cannot be written as canonical JSON: {exc}") from exc
    return text.encode("utf-8")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


def loads_canonical(data: bytes, what: str) -> Any:
    """Parse canonical JSON bytes; ``what`` names the source for error messages.

    Raises :class:`FormatError` when the bytes are not UTF-8 JSON or not canonical.
    """
    try:
        value = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise FormatError(f"{what} is not valid UTF-8 JSON: {exc}") from exc
    if dumps_canonical(value) != data:
        raise FormatError(
            f"{what} is not in canonical form (sorted keys, no whitespace); it was edited "
            "or written by another tool"
        )
    return value
