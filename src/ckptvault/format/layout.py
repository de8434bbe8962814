"""Names inside a store: generations, staging areas, files.

A store is a directory (or object prefix) holding one directory per published
generation, named ``step-<step, 12+ digits>.<generation id>``, plus ckptvault's own
bookkeeping entries, which all start with a dot and are never taken for generations.
Generation ids sort by creation time: ``<UTC timestamp, microseconds>Z-<8 hex>``.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from ckptvault.errors import FormatError, UsageError

MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"
STAGING_DIR = ".staging"
WRITER_LOCK = ".writer.lock"
TENSOR_FILE_SUFFIX = ".safetensors"
ENCRYPTED_SUFFIX = ".enc"
MAX_STEP = 2**63 - 1  # steps are stored as signed 64-bit integers (SQLite, JSON readers)
ENCRYPTED_STATE_SUFFIX = "-state.json" + ENCRYPTED_SUFFIX

_GENERATION_ID = r"[0-9]{8}T[0-9]{12}Z-[0-9a-f]{8}"
_GENERATION_ID_RE = re.compile(rf"^{_GENERATION_ID}\Z")
_GENERATION_DIR_RE = re.compile(rf"^step-([0-9]{{12,}})\.({_GENERATION_ID})\Z")
_STAMP_FORMAT = "%Y%m%dT%H%M%S%f"
_STAMP_RE = re.compile(r"([0-9]{4})([0-9]{2})([0-9]{2})T([0-9]{2})([0-9]{2})([0-9]{2})([0-9]{6})")


@dataclass(frozen=True, order=True)
class GenerationName:
    """The parsed name of a generation directory; orders oldest to newest."""

    step: int
    generation_id: str

    @property
    def dirname(self) -> str:
        return generation_dirname(self.step, self.generation_id)


def new_generation_id(now: datetime | None = None, not_before: str | None = None) -> str:
    """A fresh id, unique per save attempt, sortable by creation time.

    ``not_before`` (a generation id) makes the result sort strictly after it even when
    this machine's clock is behind: the id then uses that id's time plus 1 µs. The
    writer passes the run's newest rollback cutoff, so that a save made after an
    allowed rollback is never taken for one the rollback abandoned.

    Uses the OS entropy source, never Python's ``random``: saving must not draw from
    any RNG the training run depends on.
    """
    now = now or datetime.now(timezone.utc)
    now = now.replace(tzinfo=timezone.utc) if now.tzinfo is None else now.astimezone(timezone.utc)
    if not_before is not None:
        if not is_generation_id(not_before):
            raise UsageError(
                f"not_before must be a generation id (<UTC time>Z-<8 hex>), got {not_before!r}"
            )
        try:
            earliest = generation_id_time(not_before) + timedelta(microseconds=1)
        except OverflowError:
            raise UsageError(
                f"no generation id can sort after {not_before}: its time is the last one "
                "representable. The ledger's rollback cutoff is damaged; repair the ledger"
            ) from None
        now = max(now, earliest)
    return f"{now:%Y%m%dT%H%M%S%f}Z-{secrets.token_hex(4)}"


def is_generation_id(text: str) -> bool:
    """``<UTC time>Z-<8 hex>`` with a time that exists (no month 13: every id a
    store lists must have a creation time)."""
    if not _GENERATION_ID_RE.match(text):
        return False
    try:
        generation_id_time(text)
    except ValueError:
        return False
    return True


def generation_id_time(generation_id: str) -> datetime:
    """The UTC creation time encoded in a generation id; ``ValueError`` when it holds
    no time that exists."""
    stamp = generation_id.split("Z-", 1)[0]
    fields = _STAMP_RE.fullmatch(stamp)
    if fields is None:  # not the fixed-width form ids have: strptime judges it, as always
        return datetime.strptime(stamp, _STAMP_FORMAT).replace(tzinfo=timezone.utc)
    # Listing parses every id of a store (twice): strptime took half of an ``ls``. On
    # these fixed-width digits it reads the same fields, and datetime() refuses the
    # same impossible ones (month 13, second 60).
    year, month, day, hour, minute, second, micro = map(int, fields.groups())
    return datetime(year, month, day, hour, minute, second, micro, tzinfo=timezone.utc)


def generation_created_at(generation_id: str) -> str:
    """The ISO-8601 creation time encoded in a generation id."""
    return format_timestamp(generation_id_time(generation_id))


def format_timestamp(moment: datetime) -> str:
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def utc_now() -> str:
    """Now, as the ISO-8601 UTC timestamp every ckptvault record uses."""
    return format_timestamp(datetime.now(timezone.utc))


def generation_dirname(step: int, generation_id: str) -> str:
    return f"step-{step:012d}.{generation_id}"


def parse_generation_dirname(name: str) -> GenerationName | None:
    """Parse ``step-<n>.<id>``; anything else (staging, locks, stray files) is None."""
    match = _GENERATION_DIR_RE.match(name)
    if match is None:
        return None
    step = int(match.group(1))
    if step > MAX_STEP:
        return None
    parsed = GenerationName(step=step, generation_id=match.group(2))
    # Only the canonical spelling: "step-0000000000005" must not pass for step 5.
    if parsed.dirname != name or not is_generation_id(parsed.generation_id):
        return None
    return parsed


def tensor_file_name(rank: int, index: int) -> str:
    """Name of the ``index``-th tensor file written by ``rank``."""
    return f"r{rank:05d}-{index:03d}{TENSOR_FILE_SUFFIX}"


def encrypted_state_file_name(rank: int) -> str:
    """Name of the encrypted file holding ``rank``'s non-tensor state (encrypted runs)."""
    return f"r{rank:05d}{ENCRYPTED_STATE_SUFFIX}"


# An encrypted generation's manifest ``state`` holds only this tag, naming the file
# that holds the state tree (:mod:`ckptvault.io.state_file`).
ENCRYPTED_STATE_TAG = "$encrypted_file"


def encrypted_state_reference(state: dict[str, Any]) -> str | None:
    """The file an encrypted generation's ``state`` points to, or None when the
    state is stored in the manifest itself; FormatError for a malformed reference."""
    if set(state) != {ENCRYPTED_STATE_TAG}:
        return None
    name = state[ENCRYPTED_STATE_TAG]
    if not isinstance(name, str) or not name.endswith(ENCRYPTED_STATE_SUFFIX):
        raise FormatError(f"the manifest's encrypted state reference {name!r} is malformed")
    return name


def is_tensor_file_name(name: str) -> bool:
    """A safetensors tensor file, plain or inside an encrypted container."""
    return name.endswith((TENSOR_FILE_SUFFIX, TENSOR_FILE_SUFFIX + ENCRYPTED_SUFFIX))


def is_encrypted_name(name: str) -> bool:
    """A file stored as an encrypted container: tensor file or state file."""
    return name.endswith((TENSOR_FILE_SUFFIX + ENCRYPTED_SUFFIX, ENCRYPTED_STATE_SUFFIX))


INDEX_SUFFIX = "-index.json"
_HOLDER_RE = re.compile(r"^r([0-9]{5,7})-")


def index_file_name(holder: int) -> str:
    """Name of the index (format version 3) of the files rank ``holder`` wrote."""
    return f"r{holder:05d}{INDEX_SUFFIX}"


def file_holder(name: str) -> int | None:
    """The rank whose index covers file ``name`` (its ``r<rank>-`` prefix), or None."""
    match = _HOLDER_RE.match(name)
    if match is None:
        return None
    holder = int(match.group(1))
    # One spelling per rank: "r000001-" is not rank 1's.
    return holder if match.group(0) == f"r{holder:05d}-" else None


def is_index_file_name(name: str) -> bool:
    holder = file_holder(name)
    return holder is not None and name == index_file_name(holder)
