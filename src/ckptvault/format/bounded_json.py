"""Bounded JSON: parse bytes from the store without letting them choose the cost.

Whoever can write the store chooses these bytes (DESIGN rule 5), and they are
parsed before anything can be verified. ``json.loads`` alone recurses once per
nesting level (deep input raises ``RecursionError``), turns ``1e999`` into infinity,
accepts ``NaN`` and ``Infinity``, and spends time and memory in proportion to
whatever it is handed. :func:`loads_bounded` checks, in this order and before
``json.loads`` sees a byte:

1. the size, against the caller's cap;
2. the nesting depth, with a linear scan that skips string contents (so a ``[``
   inside a string does not count), against the caller's cap;
3. integer literals longer than :data:`MAX_INT_DIGITS` digits (CPython's default
   limit, which a process may have lifted, and which Python 3.10 lacks).

While parsing it refuses ``NaN``/``Infinity``, numbers that overflow to infinity and
an object holding the same key twice (parsers disagree on which one counts: the
safetensors header of a tensor file is read by other tools too), and afterwards
strings holding a lone surrogate (a ``"\ud800"`` escape without its
pair): UTF-8 cannot encode one, so every later ``.encode()`` of it (canonical JSON,
the audit log, a terminal) would fail far from here.
Every failure is a :class:`~ckptvault.errors.FormatError`, never a raw exception.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import numpy as np

from ckptvault.errors import FormatError

MAX_HEADER_DEPTH = 64  # tensor-file and container headers: real ones nest 3 deep
MAX_DOCUMENT_DEPTH = 128  # manifests, signatures, state trees
MAX_INT_DIGITS = 4300

_BLOCK = 1 << 20  # bytes scanned per step: bounds the scan's own memory
_WINDOW = 2048  # a run of MAX_INT_DIGITS + 1 digits fills at least one aligned window
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN_BRACKET, _OPEN_BRACE, _CLOSE_BRACKET, _CLOSE_BRACE = map(ord, "[{]}")
_ZERO, _NINE = ord("0"), ord("9")
# A \uD800-\uDFFF escape: the only way a surrogate gets into strictly decoded UTF-8.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _run_lengths(flags: np.ndarray, carried: int) -> np.ndarray:
    """For each position, how many consecutive set ``flags`` end there (0 where
    unset); ``carried`` is the run that ended just before the block."""
    index = np.arange(len(flags), dtype=np.int64)
    last_unset = np.maximum.accumulate(np.where(flags, -1, index))
    runs = index - last_unset
    return np.where(last_unset < 0, runs + carried, runs)


def scan_json(data: bytes | bytearray | memoryview, max_depth: int) -> str | None:
    """Why JSON ``data`` must not be handed to ``json.loads``, or None.

    Checks, outside string contents, that containers nest at most ``max_depth``
    deep and that no number has more than :data:`MAX_INT_DIGITS` digits. Linear in
    the input, vectorised, never recursive, its memory bounded by the block size.
    Exact on every prefix that is valid JSON; ``json.loads`` stops at the first byte
    that is not, so it never descends deeper than this scan saw.
    """
    view = np.frombuffer(data, dtype=np.uint8)
    # Carried from one block to the next: inside a string?, depth, trailing runs.
    inside, depth, backslashes, digits = False, 0, 0, 0
    for start in range(0, len(view), _BLOCK):
        block = view[start : start + _BLOCK]
        is_quote = block == _QUOTE
        is_backslash = block == _BACKSLASH
        if backslashes or is_backslash.any():
            # A quote after an odd run of backslashes is escaped (only inside strings
            # are backslashes valid JSON, so this is exact on every valid prefix).
            escapes = _run_lengths(is_backslash, backslashes)
            before = np.concatenate(([backslashes], escapes[:-1]))
            is_quote &= before % 2 == 0
            backslashes = int(escapes[-1])
        # Quote parity: a string's opening quote and contents count as inside.
        within = np.bitwise_xor.accumulate(is_quote) ^ inside
        outside = ~within
        # The depth after each bracket outside strings (between brackets it does not
        # change, so these are all the values the running depth takes).
        opens = (block == _OPEN_BRACKET) | (block == _OPEN_BRACE)
        closes = (block == _CLOSE_BRACKET) | (block == _CLOSE_BRACE)
        brackets = np.flatnonzero((opens | closes) & outside)
        levels = np.cumsum(np.where(opens[brackets], 1, -1), dtype=np.int64)
        if depth + int(levels.max(initial=0)) > max_depth:
            return f"nests JSON deeper than {max_depth} levels"
        depth += int(levels[-1]) if len(levels) else 0
        inside = bool(within[-1])
        number = outside & (block >= _ZERO) & (block <= _NINE)
        padded = np.zeros(-(-len(number) // _WINDOW) * _WINDOW, dtype=bool)
        padded[: len(number)] = number
        if digits or padded.reshape(-1, _WINDOW).all(axis=1).any():
            runs = _run_lengths(number, digits)
            if int(runs.max(initial=0)) > MAX_INT_DIGITS:
                return f"holds a number longer than {MAX_INT_DIGITS} digits"
        # The run of digits the block ends with continues into the next one.
        last_other = int(np.argmin(number[::-1]))
        digits = last_other if not number[len(number) - 1 - last_other] else len(number) + digits
    return None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``'s object hook: a dict, unless a key repeats."""
    value = dict(pairs)
    if len(value) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return value


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} does not fit a float")
    return value


def loads_bounded(
    data: bytes | bytearray | memoryview,
    what: str,
    *,
    max_depth: int,
    max_bytes: int | None = None,
    unique_keys: bool = True,
) -> Any:
    """Parse UTF-8 JSON ``data`` after bounding its size and nesting depth.

    ``what`` names the source for error messages. Raises :class:`FormatError`.
    ``unique_keys=False`` leaves the refusal of repeated keys to the caller, which
    must then prove it another way (a repeated key keeps only its last value, so
    ``loads_canonical``'s re-encoding of the value no longer gives ``data``); the
    check costs a Python call per object, a third of the parse on large documents.
    """
    data = bytes(data)
    if max_bytes is not None and len(data) > max_bytes:
        raise FormatError(f"{what} is {len(data)} bytes, more than the {max_bytes} allowed")
    refusal = scan_json(data, max_depth)
    if refusal is not None:
        raise FormatError(f"{what} {refusal}; ckptvault never writes that")
    try:
        value = json.loads(
            data.decode("utf-8"),
            parse_constant=_reject_constant,
            parse_float=_finite_float,
            object_pairs_hook=_unique_keys if unique_keys else None,
        )
    except _DuplicateKey as exc:
        raise FormatError(
            f"{what} holds the key {exc.key[:100]!r} twice in one object; readers disagree on "
            "which one counts, and ckptvault never writes that"
        ) from None
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise FormatError(f"{what} is not valid UTF-8 JSON: {exc}") from exc
    if _SURROGATE_ESCAPE.search(data) and _has_lone_surrogate(value):
        raise FormatError(
            f"{what} holds a string with a lone surrogate escape (\\ud800-\\udfff), which is "
            "not text; ckptvault never writes that"
        )
    return value


def _has_lone_surrogate(value: Any) -> bool:
    """Whether any string (or object key) in a parsed document cannot be UTF-8."""
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            strings = [item]
        elif isinstance(item, dict):
            strings = list(item)
            pending.extend(item.values())
        elif isinstance(item, list):
            pending.extend(item)
            continue
        else:
            continue
        for text in strings:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:
                return True
    return False
