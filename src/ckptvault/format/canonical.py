"""Canonical JSON: one byte string per value, so that exact bytes can be signed.

The form is UTF-8, keys sorted, no insignificant whitespace, no NaN/Infinity
literals (the state codec tags those before they get here). ``loads_canonical``
refuses input that is not already in canonical form, so two readers can never
disagree about what a manifest says. It parses through
:func:`ckptvault.format.bounded_json.loads_bounded`: what it reads comes from the
store, so its size and nesting depth are bounded before ``json.loads`` runs.
"""

from __future__ import annotations

import json
from typing import Any, NoReturn

from ckptvault.errors import FormatError
from ckptvault.format.bounded_json import MAX_DOCUMENT_DEPTH, loads_bounded

# One encoder for every call: json.dumps with options builds a new one each time,
# which costs more than encoding a short string (a writer encodes one per tensor).
_CANONICAL = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
)


def dumps_canonical(value: Any) -> bytes:
    """Serialize ``value`` to canonical JSON bytes."""
    try:
        # Strict UTF-8: a lone surrogate (from a "\ud800" escape, or a file name that
        # is not UTF-8) has no canonical encoding.
        return _CANONICAL.encode(value).encode("utf-8")
    except ValueError as exc:  # NaN/inf or a lone surrogate (UnicodeEncodeError)
        raise FormatError(f"value cannot be written as canonical JSON: {exc}") from exc


def join_canonical_object(members: dict[str, bytes]) -> bytes:
    """The canonical bytes of a JSON object whose members are already encoded:
    ``members`` maps each key to :func:`dumps_canonical` of its value. Equal to
    ``dumps_canonical`` of the object itself (keys sorted the same way, the same
    separators), so a large member that does not change can be encoded once."""
    return b"{" + b",".join(dumps_canonical(k) + b":" + members[k] for k in sorted(members)) + b"}"


def loads_canonical(
    data: bytes, what: str, *, max_depth: int = MAX_DOCUMENT_DEPTH, max_bytes: int | None = None
) -> Any:
    """Parse canonical JSON bytes; ``what`` names the source for error messages.

    Raises :class:`FormatError` when the bytes are longer than ``max_bytes``, nest
    deeper than ``max_depth``, are not UTF-8 JSON, or are not canonical.
    """
    value = loads_bounded(data, what, max_depth=max_depth, max_bytes=max_bytes, unique_keys=False)
    if dumps_canonical(value) != data:
        _refuse(data, what, max_depth, max_bytes)
    return value


def loads_canonical_members(
    data: bytes, what: str, *, max_depth: int = MAX_DOCUMENT_DEPTH, max_bytes: int | None = None
) -> tuple[Any, dict[str, bytes] | None]:
    """:func:`loads_canonical`, and for a JSON object the canonical bytes of each of
    its top-level members (key -> encoded value; None for any other value): the
    canonical bytes of the object less some members are then a join away
    (:func:`join_canonical_object`), without encoding the document a second time."""
    value = loads_bounded(data, what, max_depth=max_depth, max_bytes=max_bytes, unique_keys=False)
    if not isinstance(value, dict):
        if dumps_canonical(value) != data:
            _refuse(data, what, max_depth, max_bytes)
        return value, None
    members = {key: dumps_canonical(member) for key, member in value.items()}
    if join_canonical_object(members) != data:
        _refuse(data, what, max_depth, max_bytes)
    return value, members


def _refuse(data: bytes, what: str, max_depth: int, max_bytes: int | None) -> NoReturn:
    """Why parsed ``data`` is not canonical. A repeated key is the one thing the
    quick parse let through (it keeps the last value, so the re-encoding differs):
    the careful parse names it; anything else is a plain non-canonical form."""
    loads_bounded(data, what, max_depth=max_depth, max_bytes=max_bytes, unique_keys=True)
    raise FormatError(
        f"{what} is not in canonical form (sorted keys, no whitespace); it was edited "
        "or written by another tool"
    )
