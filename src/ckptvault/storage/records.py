"""Store records: small JSON documents a store keeps about its generations.

Retention marks a generation for deletion before its bytes go (``deleted``), an
operator pins one (``pinned``), a reader holds a lease while it restores
(``lease``). They live in the store, beside what they describe, so that every
process that opens the store sees them — and so whoever can write the store can
write them too. That is why a record may only ever withhold a generation from
restore or keep one from deletion: nothing a record says makes bytes count as
verified. Keys and sizes are bounded like everything else read from a store, and so
is how many records one listing reads: a caller names the records it can use
(``accept``, judged on the name alone, before anything is read) and how many it
reads at most (``limit``; the rest are left unread, with a warning), so thousands of
planted records cost a listing, not thousands of reads.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable
from typing import Any

from ckptvault.errors import FormatError, UsageError
from ckptvault.format.canonical import dumps_canonical, loads_canonical

RECORDS_DIR = ".records"
RECORD_SUFFIX = ".json"
MAX_RECORD_BYTES = 64 * 1024
MAX_RECORD_DEPTH = 16

DELETION_MARK = "deleted"
PIN = "pinned"
LEASE = "lease"
REPLICA = "replica"  # a verified copy reached another tier (replication.replicator)

# The most records of one kind that retention reads from a store in one listing when
# the store's own generations do not bound them (marks of generations it no longer
# lists, leases). ckptvault itself leaves a handful; more are left for later passes.
MAX_RECORDS_READ = 256

RecordFilter = Callable[[str], bool]

logger = logging.getLogger("ckptvault")

_KIND_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}\Z")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}\Z")


def check_record_key(kind: str, name: str) -> None:
    """A kind is a lowercase word; a name a plain, non-hidden file-name-like key."""
    if not _KIND_RE.match(kind) or not _NAME_RE.match(name) or ".." in name:
        raise UsageError(f"invalid store record key {kind!r}/{name!r}")


def encode_record(data: dict[str, Any]) -> bytes:
    encoded = dumps_canonical(data)
    if len(encoded) > MAX_RECORD_BYTES:
        raise UsageError(f"a store record may hold at most {MAX_RECORD_BYTES} bytes")
    return encoded


def decode_record(raw: bytes, where: str) -> dict[str, Any] | None:
    """The record, or None when it is not one ckptvault wrote (it is then ignored)."""
    try:
        value = loads_canonical(raw, where, max_depth=MAX_RECORD_DEPTH, max_bytes=MAX_RECORD_BYTES)
    except FormatError:
        return None
    return value if isinstance(value, dict) else None


def record_name_of(file_name: str) -> str | None:
    """The record name stored in ``file_name``, or None for anything else."""
    if not file_name.endswith(RECORD_SUFFIX):
        return None
    name = file_name[: -len(RECORD_SUFFIX)]
    return name if _NAME_RE.match(name) and ".." not in name else None


def records_to_read(
    names: Iterable[str],
    kind: str,
    where: str,
    accept: RecordFilter | None = None,
    limit: int | None = None,
) -> list[str]:
    """The record names a listing reads, in name order: those ``accept`` takes (every
    one when None), at most ``limit`` of them; a warning says how many were left
    unread."""
    wanted = sorted(name for name in names if accept is None or accept(name))
    if limit is not None and len(wanted) > limit:
        logger.warning(
            "%s holds %d %r records retention could use; %d are read now, the rest are "
            "left for later passes",
            where,
            len(wanted),
            kind,
            limit,
        )
        return wanted[:limit]
    return wanted
