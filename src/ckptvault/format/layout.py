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
from datetime import datetime, timezone

MANIFEST_NAME = "manifest.json"
SIGNATURE_NAME = "manifest.sig"
STAGING_DIR = ".staging"
WRITER_LOCK = ".writer.lock"
TENSOR_FILE_SUFFIX = ".safetensors"

_GENERATION_ID = r"[0-9]{8}T[0-9]{12}Z-[0-9a-f]{8}"
_GENERATION_ID_RE = re.compile(rf"^{_GENERATION_ID}$")
_GENERATION_DIR_RE = re.compile(rf"^step-([0-9]{{12,}})\.({_GENERATION_ID})$")


@dataclass(frozen=True, order=True)
class GenerationName:
    """The parsed name of a generation directory; orders oldest to newest."""

    step: int
    generation_id: str

    @property
    def dirname(self) -> str:
        return generation_dirname(self.step, self.generation_id)


def new_generation_id(now: datetime | None = None) -> str:
    """A fresh id, unique per save attempt, sortable by creation time.

    Uses the OS entropy source, never Python's ``random``: saving must not draw from
    any RNG the training run depends on.
    """
    now = now or datetime.now(timezone.utc)
    return f"{now:%Y%m%dT%H%M%S%f}Z-{secrets.token_hex(4)}"


def is_generation_id(text: str) -> bool:
    return bool(_GENERATION_ID_RE.match(text))


def generation_created_at(generation_id: str) -> str:
    """The ISO-8601 creation time encoded in a generation id."""
    stamp = generation_id.split("Z-", 1)[0]
    parsed = datetime.strptime(stamp, "%Y%m%dT%H%M%S%f").replace(tzinfo=timezone.utc)
    return format_timestamp(parsed)


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
    return GenerationName(step=int(match.group(1)), generation_id=match.group(2))


def tensor_file_name(rank: int, index: int) -> str:
    """Name of the ``index``-th tensor file written by ``rank``."""
    return f"r{rank:05d}-{index:03d}{TENSOR_FILE_SUFFIX}"
