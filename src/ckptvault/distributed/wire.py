"""Checks for JSON another rank sent: plain values of the expected type and range.

A message between ranks is parsed by the coordinator's bounded loader into plain
JSON values (:mod:`ckptvault.distributed.coordinator`); the codecs of
:mod:`~ckptvault.distributed.plan_wire` and :mod:`~ckptvault.distributed.result_wire`
then take every field through these helpers before it becomes an object, so that a
rank that sends a float, a bool, a negative or astronomically large number, a string
of a megabyte or an object with keys of its own choosing makes the receiver raise
:class:`~ckptvault.errors.PeerMessageError` naming the rank and the field, and never
reaches DCP's planner or the manifest.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from typing import Any

from ckptvault.errors import PeerMessageError
from ckptvault.format.layout import tensor_file_name
from ckptvault.io.writer import MAX_GENERATION_FILES

MAX_ERROR_CHARS = 2000  # characters of a rank's error text carried to the others
MAX_HINT = 2**31  # DCP's chunk index hints: a position among a tensor's chunks
_FILE_RE = re.compile(r"^r[0-9]{5,7}-([0-9]{3,4})\.safetensors(\.enc)?\Z")


class Field:
    """Where in a message from rank ``rank`` a value was found, for errors."""

    def __init__(self, rank: int, what: str) -> None:
        self.rank = rank
        self.what = what

    def refuse(self, problem: str) -> PeerMessageError:
        return PeerMessageError(
            f"rank {self.rank} sent {self.what} that ckptvault never sends ({problem}); "
            "refused, nothing in it was used. A bug or a dishonest rank: every rank stops "
            "this save or restore"
        )

    def mapping(self, value: Any, keys: Collection[str], name: str) -> dict[str, Any]:
        """``value`` as an object with exactly ``keys``."""
        if not isinstance(value, dict) or set(value) != set(keys):
            shown = sorted(value)[:5] if isinstance(value, dict) else type(value).__name__
            raise self.refuse(f"{name} must be an object with keys {sorted(keys)}, not {shown}")
        return value

    def sequence(self, value: Any, name: str, length: int | None = None) -> list[Any]:
        if not isinstance(value, list) or (length is not None and len(value) != length):
            wanted = "a list" if length is None else f"a list of {length}"
            raise self.refuse(f"{name} must be {wanted}")
        return value

    def count(self, value: Any, name: str, low: int, high: int) -> int:
        """A plain int (never a bool or float) in ``low..high``."""
        if type(value) is not int or not low <= value <= high:
            raise self.refuse(f"{name} must be an integer in {low}..{high}")
        return value

    def counts(self, value: Any, name: str, length: int, high: int) -> list[int]:
        items = self.sequence(value, name, length)
        return [self.count(item, name, 0, high) for item in items]

    def text(self, value: Any, name: str, most: int, least: int = 1) -> str:
        if not isinstance(value, str) or not least <= len(value) <= most:
            raise self.refuse(f"{name} must be a string of {least}..{most} characters")
        return value

    def tensor_file(self, name: Any, rank: int, world: int, encrypted: bool | None) -> str:
        """``name`` if it is one of rank ``rank``'s tensor files in a job of ``world``
        ranks (``r<rank>-<n>.safetensors``, ``.enc`` for an encrypted run; either
        when ``encrypted`` is None)."""
        match = _FILE_RE.match(name) if isinstance(name, str) else None
        if (
            match is None
            or (encrypted is not None and bool(match.group(2)) != encrypted)
            or int(match.group(1)) >= max(1, MAX_GENERATION_FILES // max(1, world))
            or name != tensor_file_name(rank, int(match.group(1))) + (match.group(2) or "")
        ):
            raise self.refuse(f"file {str(name)[:80]!r} is not one of rank {rank}'s tensor files")
        return name

    def choice(self, value: Any, name: str, allowed: Collection[str]) -> str:
        if not isinstance(value, str) or value not in allowed:
            raise self.refuse(f"{name} must be one of {sorted(allowed)}")
        return value


def error_message(exc: BaseException) -> dict[str, str]:
    """What a rank whose step failed sends instead of its result."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return {"error": text[:MAX_ERROR_CHARS]}


def error_of(message: Any, field: Field) -> str | None:
    """The error text of an error message, None for any other message; a malformed
    error message is refused."""
    if isinstance(message, dict) and "error" in message:
        checked = field.mapping(message, ("error",), "an error message")
        return field.text(checked["error"], "an error text", MAX_ERROR_CHARS)
    return None
