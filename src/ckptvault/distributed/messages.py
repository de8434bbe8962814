"""The small messages of a multi-rank save and restore, checked on arrival.

Every rank receives the same bytes in a broadcast or an all-gather, so every rank
runs the same check on them and, for a message that is not what ckptvault sends,
raises the same :class:`~ckptvault.errors.PeerMessageError` at the same point:
the ranks stay in step, and nothing a rank sent reaches a ``set``, an f-string or a
store call as anything but the plain value it was checked to be.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ckptvault.distributed.wire import MAX_ERROR_CHARS, Field
from ckptvault.format.layout import index_file_name
from ckptvault.trust.problems import MAX_DETAIL, MAX_PROBLEMS

if TYPE_CHECKING:
    from ckptvault.coordinator import Coordinator

_CODE_RE = re.compile(r"^[a-z][a-z0-9-]{0,63}\Z")  # a problem's reason code
_HEX64_RE = re.compile(r"^[0-9a-f]{64}\Z")
_MAX_KIND = 100  # an exception class name
_MAX_SLOT = 8192  # a replica slot: a tensor key and a shard's offsets
_MAX_FILE_NAME = 1024  # a store entry's name (an S3 key's length)
# A problem's detail: at most MAX_DETAIL characters and "...", or the summary of
# the problems left out, which lists their codes.
_MAX_DETAIL_CHARS = MAX_DETAIL + 4096
MAX_REFUSAL_CHARS = 20_000  # a rank's reason not to apply the state (a list of entries)


def outcome(raw: Any, rank: int, what: str) -> str | None:
    """A rank's outcome of a save phase: None, or its error text."""
    if raw is None:
        return None
    field = Field(rank, f"its outcome of {what}")
    return field.text(raw, "an error text", MAX_ERROR_CHARS, least=0)


def any_rank(coordinator: Coordinator, mine: bool, what: str) -> bool:
    """Whether ``mine`` is true on any rank (an all-gather). Every rank's answer must be
    ``true`` or ``false``: a truthy string or list is refused alike on every rank."""
    found = False
    for rank, raw in enumerate(coordinator.all_gather(bool(mine))):
        if type(raw) is not bool:
            raise Field(rank, what).refuse("not true or false")
        found = found or raw
    return found


def problems(raw: Any, rank: int) -> list[tuple[str, str, str | None]]:
    """A rank's verdict on a restore stage: its problems (code, detail, file)."""
    field = Field(rank, "its verdict on a candidate")
    found = field.sequence(raw, "problems")
    if len(found) > MAX_PROBLEMS + 1:  # GenerationRejected keeps 20 and a summary
        raise field.refuse(f"{len(found)} problems, more than a rejection keeps")
    checked = []
    for entry in found:
        code, detail, file = field.sequence(entry, "a problem", 3)
        if not isinstance(code, str) or not _CODE_RE.match(code):
            raise field.refuse("a problem's code is not a reason code")
        detail = field.text(detail, "a problem's detail", _MAX_DETAIL_CHARS, least=0)
        if file is not None:
            file = field.text(file, "a problem's file", _MAX_FILE_NAME)
        checked.append((code, detail, file))
    return checked


def refusal(raw: Any, rank: int) -> tuple[str, str] | None:
    """A rank's verdict on applying the restored state: None, or (error kind, text)."""
    if raw is None:
        return None
    field = Field(rank, "its verdict on applying the state")
    kind, text = field.sequence(raw, "a refusal", 2)
    if not isinstance(kind, str) or not kind.isidentifier() or len(kind) > _MAX_KIND:
        raise field.refuse("an error kind that is not a class name")
    return kind, field.text(text, "an error text", MAX_REFUSAL_CHARS, least=0)


def manifest_digest(raw: Any, rank: int) -> str:
    """The BLAKE3 (hex) of the manifest bytes a rank checked."""
    if not isinstance(raw, str) or not _HEX64_RE.match(raw):
        raise Field(rank, "the digest of the manifest it read").refuse("not 64 hex digits")
    return raw


def rank_part(raw: Any, rank: int, world: int) -> dict[str, Any]:
    """A rank's part of a save (phase 4): its own state tree, the tensor files it
    wrote and its index (its own names only: they are adopted into the attempt) and, unless
    replicas go unchecked, the digest of each replicated slot."""
    field = Field(rank, "its part of the save")
    if not isinstance(raw, dict) or set(raw) not in (
        {"tree", "files"},
        {"tree", "files", "digests"},
    ):
        raise field.refuse("its part must be an object with a tree, files and digests")
    if not isinstance(raw["tree"], dict):
        raise field.refuse("its state tree must be an object")
    files = field.sequence(raw["files"], "files")
    for name in files:
        if name != index_file_name(rank):  # its own index (format 3), or a tensor file
            field.tensor_file(name, rank, world, None)
    digests = raw.get("digests", {})
    if not isinstance(digests, dict) or not all(
        len(slot) <= _MAX_SLOT and isinstance(digest, str) and _HEX64_RE.match(digest)
        for slot, digest in digests.items()
    ):
        raise field.refuse("replica digests must map slots to 64 hex digits")
    return raw
