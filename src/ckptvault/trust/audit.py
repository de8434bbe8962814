"""The audit log: append-only JSON lines, each entry chained to the previous one.

Every entry carries ``seq`` (its position), ``prev`` (the previous entry's hash)
and ``hash`` (BLAKE3 of the entry's canonical JSON without ``hash``). Removing,
editing or reordering an entry breaks the chain; cutting off the tail is detected
by comparing with the head (count and last hash) kept in the ledger. Appends hold
an exclusive ``flock`` on the log, so several processes may share one log.

An append first checks the log against the ledger's head. Chaining onto whatever
the last line is would let the next head vouch for a log that lost its tail (or was
rewritten, or grew entries the ledger never saw), laundering the loss. So when they
disagree, the append starts a new, linked segment: a ``gap`` entry, chained onto the
log's last intact entry, records what the ledger expected (``expected_entries``,
``expected_hash``) and what was found (``found_entries``, ``found_hash``), and a
WARNING is logged. A damaged tail (a cut-off last line, or lines that are no
entry) stays where it is as evidence; the gap entry records its size and BLAKE3
(``damaged_bytes``, ``damaged_blake3``). A log holding a gap never verifies again:
keep it as evidence, find out what happened, and start a new log.

A crash (a kill, a power cut) between writing an entry and recording the new head
must not pass for tampering. So the ledger is told of each append before its bytes
are written (:class:`~ckptvault.trust.ledger.PendingAppend`: the log's size before
it and after it, the head after it), and the head replaces that intent once the
bytes are durable. The next append (and ``audit verify``) settles an intent a crash
left behind: a log of the intended size that ends at the intended head arrived
whole and is adopted; one no longer than that whose bytes up to the size before end
at the old head lost the append, and its partial bytes are cut off. Anything else
is a gap, as above. Only the ledger, which the log's writers cannot write, can
vouch for an append this way.

Events: ``save``, ``restore``, ``refusal``, ``rollback_allowed``, ``export``,
``key_destroyed``, ``delete``, ``signed`` (``ckptvault sign``), and ``gap`` (written
by the log itself).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blake3 import blake3

from ckptvault.durable import fsync_directory, make_dirs_durable
from ckptvault.errors import AuditError, FormatError
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.layout import utc_now
from ckptvault.trust.ledger import Ledger, PendingAppend, default_state_dir

logger = logging.getLogger("ckptvault")

GENESIS = "0" * 64
GAP_EVENT = "gap"
_TAIL_BYTES = 1 << 20

# What a gap entry's ``kind`` says about the log and the ledger's head.
TRUNCATED = "truncated"  # fewer entries than the head: the tail was lost
REWRITTEN = "rewritten"  # the entry at the head's position is another one
UNRECORDED = "unrecorded"  # entries after the head, appended without this ledger
NO_HEAD = "no-head"  # the ledger holds heads of other logs, none of this one
DAMAGED = "damaged"  # only a damaged tail; the intact entries agree with the head


def default_audit_path(ledger: Ledger | None = None) -> Path:
    """``audit.jsonl`` beside the ledger that keeps its head (default state dir)."""
    return (ledger.path.parent if ledger is not None else default_state_dir()) / "audit.jsonl"


def entry_hash(entry: dict[str, Any]) -> str:
    body = {k: v for k, v in entry.items() if k != "hash"}
    return blake3(dumps_canonical(body)).hexdigest()


def parse_line(line: bytes) -> Any:
    try:
        return json.loads(line)
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None


def _intact_entry(line: bytes) -> dict[str, Any] | None:
    """The entry on ``line`` when it looks like one the log wrote (chain not checked)."""
    entry = parse_line(line)
    if (
        isinstance(entry, dict)
        and type(entry.get("seq")) is int
        and entry["seq"] >= 0
        and isinstance(entry.get("hash"), str)
    ):
        return entry
    return None


@dataclass(frozen=True)
class _Tail:
    """The log's last intact entry, and the bytes after it that are no entry."""

    entries: int  # the last intact entry's seq + 1; 0 when there is none
    last_hash: str  # its hash; GENESIS when there is none
    damaged: bytes  # a cut-off last line, or lines that are no entry


def _tail_of(data: bytes, whole: bool) -> _Tail | None:
    """Scan ``data`` (the end of the log; all of it when ``whole``) backwards for the
    last intact entry; None when it may begin before ``data`` does."""
    end = data.rfind(b"\n") + 1  # just past the last complete line; 0: none
    while end > 0:
        start = data.rfind(b"\n", 0, end - 1) + 1
        if start == 0 and not whole:
            return None  # this line may begin before the bytes read
        entry = _intact_entry(data[start : end - 1])
        if entry is not None:
            return _Tail(entry["seq"] + 1, entry["hash"], data[end:])
        end = start
    return _Tail(0, GENESIS, data) if whole else None


def _read_all(fd: int, size: int) -> bytes:
    chunks, offset = [], 0
    while offset < size:
        chunk = os.pread(fd, min(size - offset, 16 << 20), offset)
        if not chunk:
            break
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def settled(
    data: bytes, head: tuple[int, str] | None, pending: PendingAppend
) -> tuple[int, tuple[int, str] | None]:
    """How many bytes of the log ``data`` count, and its head, given an append the
    ledger says was in flight: all of them and the intended head when the append
    arrived whole; those before it and the old head when it did not; otherwise all of
    them and the old head (a gap, if they disagree)."""
    if len(data) == pending.size_after:
        whole = _tail_of(data, whole=True)
        assert whole is not None
        intended = (pending.entries, pending.last_hash)
        if not whole.damaged and (whole.entries, whole.last_hash) == intended:
            return len(data), intended
    if pending.size_before <= len(data) <= pending.size_after:
        before = _tail_of(data[: pending.size_before], whole=True)
        assert before is not None
        if not before.damaged and (head is None or (before.entries, before.last_hash) == head):
            return pending.size_before, head
    return len(data), head


def _read_tail(fd: int) -> _Tail:
    size = os.fstat(fd).st_size
    if size == 0:
        return _Tail(0, GENESIS, b"")
    start = max(0, size - _TAIL_BYTES)
    tail = _tail_of(os.pread(fd, size - start, start), whole=start == 0)
    if tail is None:  # no intact entry in the last MiB: look at everything
        tail = _tail_of(_read_all(fd, size), whole=True)
    assert tail is not None  # a whole log always has a tail
    return tail


def _hash_at(fd: int, position: int) -> str | None:
    """The hash of the entry at ``position`` (line and seq agree), else None."""
    lines = _read_all(fd, os.fstat(fd).st_size).split(b"\n")
    entry = _intact_entry(lines[position]) if position < len(lines) - 1 else None
    return entry["hash"] if entry is not None and entry["seq"] == position else None


def as_count(value: Any) -> int | None:
    return value if type(value) is int else None


def describe_entries(first: int, end: int) -> str:
    """``the entry with seq 4 was`` / ``the entries with seq 3-4 were``."""
    if end - first == 1:
        return f"the entry with seq {first} was"
    return f"the entries with seq {first}-{end - 1} were"


def describe_gap(gap: Mapping[str, Any]) -> str:
    """What a gap entry's fields say was lost, in words."""
    kind = gap.get("kind")
    expected = as_count(gap.get("expected_entries"))
    found = as_count(gap.get("found_entries"))
    if kind == TRUNCATED and expected is not None and found is not None:
        text = (
            f"the ledger recorded {expected} entries but only {found} were left: "
            f"{describe_entries(found, expected)} lost (cut off or deleted)"
        )
    elif kind == REWRITTEN and expected is not None:
        text = (
            f"the entry with seq {expected - 1} is not the one the ledger recorded as its "
            f"head: the log was rewritten or replaced ({found} entries found), so none of its "
            f"first {expected} entries can be trusted"
        )
    elif kind == UNRECORDED and expected is not None and found is not None:
        text = (
            f"the log held {found} entries but the ledger recorded {expected}: "
            f"{describe_entries(expected, found)} appended without the ledger"
        )
    elif kind == NO_HEAD:
        text = (
            f"the ledger holds no head for this log although it holds heads of others: its "
            f"{found} entries were not written through this ledger, or the log replaced one "
            "the ledger knew"
        )
    elif kind == DAMAGED:
        text = "the log's tail was damaged"
    else:
        text = f"the log disagreed with the ledger's head ({kind!r})"
    damaged = as_count(gap.get("damaged_bytes"))
    if damaged:
        after = f"the last intact entry (seq {found - 1})" if found else "the start of the log"
        text += (
            f"; {damaged} damaged bytes (a cut-off or unreadable entry) after {after} are kept "
            "just before the gap entry as evidence"
        )
    return text


class AuditLog:
    def __init__(self, path: str | os.PathLike[str], ledger: Ledger | None) -> None:
        self.path = Path(os.path.realpath(os.fspath(path)))
        self.ledger = ledger

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        """Append one entry; first a ``gap`` entry when the log disagrees with the
        ledger's head (see the module docstring). Returns the entry appended."""
        try:
            dumps_canonical(fields)  # every value needs a canonical form; check before the log
        except FormatError as exc:
            raise AuditError(f"cannot record a {event!r} entry in {self.path}: {exc}") from exc
        try:
            make_dirs_durable(self.path.parent, mode=0o700)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise AuditError(f"cannot open audit log {self.path}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            head = self._settled_head(fd)
            tail = _read_tail(fd)
            seq, prev = tail.entries, tail.last_hash
            data = b""
            gap = self._gap(fd, tail, head)
            if gap is not None:
                logger.warning(
                    "audit log %s (ledger %s): %s. Recorded a gap entry and went on; "
                    "`ckptvault audit verify` fails for this log from now on: keep it as "
                    "evidence, find out what happened, and start a new log",
                    self.path,
                    self.ledger.path if self.ledger is not None else "none",
                    describe_gap(gap),
                )
                if tail.damaged and not tail.damaged.endswith(b"\n"):
                    data += b"\n"  # end the cut-off line; its bytes stay as evidence
                marker = _chained(seq, prev, GAP_EVENT, gap)
                data += dumps_canonical(marker) + b"\n"
                seq, prev = seq + 1, marker["hash"]
            entry = _chained(seq, prev, event, fields)
            data += dumps_canonical(entry) + b"\n"
            self._write(fd, data, entry)
        except OSError as exc:
            raise AuditError(
                f"cannot append to audit log {self.path}: {exc.strerror or exc}; check the "
                "disk and its permissions, then run `ckptvault audit verify` on it"
            ) from exc
        finally:
            os.close(fd)  # releases the lock
        return entry

    def _settled_head(self, fd: int) -> tuple[int, str] | None:
        """The ledger's head of this log, once an append a crash cut short is settled
        (see the module docstring): adopted whole, or its partial bytes cut off."""
        if self.ledger is None:
            return None
        key = str(self.path)
        head = self.ledger.audit_head(key)
        pending = self.ledger.audit_pending(key)
        if pending is None:
            return head
        size = os.fstat(fd).st_size
        keep, settled_head = settled(_read_all(fd, size), head, pending)
        if keep < size:
            os.ftruncate(fd, keep)
            os.fsync(fd)
        if settled_head is not None and settled_head != head:
            self.ledger.set_audit_head(key, *settled_head)
        else:
            self.ledger.forget_audit_append(key)
        return settled_head

    def _write(self, fd: int, data: bytes, entry: dict[str, Any]) -> None:
        """Append ``data`` (ending with ``entry``) durably, its intent told to the ledger
        first and the new head after."""
        size = os.fstat(fd).st_size
        if self.ledger is not None:
            intent = PendingAppend(size, size + len(data), entry["seq"] + 1, entry["hash"])
            self.ledger.begin_audit_append(str(self.path), intent)
        written = 0
        while written < len(data):
            written += os.write(fd, data[written:])
        os.fsync(fd)
        if size == 0:  # a new log: its name must survive a crash too
            fsync_directory(self.path.parent)
        if self.ledger is not None:
            self.ledger.set_audit_head(str(self.path), entry["seq"] + 1, entry["hash"])

    def _gap(self, fd: int, tail: _Tail, head: tuple[int, str] | None) -> dict[str, Any] | None:
        """The fields of the gap entry to write first, or None when the log is what the
        ledger expects (or, with no head anywhere in the ledger, cannot be checked)."""
        if head is None:
            if tail.entries == 0 and not tail.damaged:
                return None  # a new log
            if tail.entries and self.ledger is not None and self.ledger.has_audit_heads():
                kind = NO_HEAD
            elif tail.damaged:
                kind = DAMAGED
            elif self.ledger is None:
                return None  # no ledger, no head to check against
            else:
                # A fresh ledger: nothing says what the log should hold.
                logger.warning(
                    "audit log %s has %d entries but the ledger %s keeps no audit head yet; "
                    "the log is adopted as it stands, so a cut made before now cannot be "
                    "detected",
                    self.path,
                    tail.entries,
                    self.ledger.path,
                )
                return None
        else:
            count, last_hash = head
            if tail.entries < count:
                kind = TRUNCATED
            elif tail.entries == count and tail.last_hash == last_hash:
                if not tail.damaged:
                    return None  # what the ledger expects
                kind = DAMAGED
            elif tail.entries == count:
                kind = REWRITTEN
            else:
                at_head = _hash_at(fd, count - 1) if count else GENESIS
                kind = UNRECORDED if at_head == last_hash else REWRITTEN
        gap: dict[str, Any] = {
            "kind": kind,
            "expected_entries": head[0] if head is not None else None,
            "expected_hash": head[1] if head is not None else None,
            "found_entries": tail.entries,
            "found_hash": tail.last_hash,
        }
        if tail.damaged:
            evidence = tail.damaged if tail.damaged.endswith(b"\n") else tail.damaged + b"\n"
            gap["damaged_bytes"] = len(evidence)
            gap["damaged_blake3"] = blake3(evidence).hexdigest()
        return gap


def _chained(seq: int, prev: str, event: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    entry: dict[str, Any] = {"seq": seq, "time": utc_now(), "event": event, **fields, "prev": prev}
    entry["hash"] = entry_hash(entry)
    return entry
