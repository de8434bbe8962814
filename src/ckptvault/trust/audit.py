"""The audit log: append-only JSON lines, each entry chained to the previous one.

Every entry carries ``seq`` (its position), ``prev`` (the previous entry's hash)
and ``hash`` (BLAKE3 of the entry's canonical JSON without ``hash``). Removing,
editing or reordering an entry breaks the chain; cutting off the tail is detected
by comparing with the head (count and last hash) kept in the ledger. Appends hold
an exclusive ``flock`` on the log, so several processes may share one log.

Events: ``save``, ``restore``, ``refusal``, ``rollback_allowed``, ``export``,
``key_destroyed``, ``delete``.
"""

from __future__ import annotations

import fcntl
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blake3 import blake3

from ckptvault.errors import AuditError
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.layout import utc_now
from ckptvault.trust.ledger import Ledger, default_state_dir

GENESIS = "0" * 64
_TAIL_BYTES = 1 << 20


def default_audit_path() -> Path:
    return default_state_dir() / "audit.jsonl"


def entry_hash(entry: dict[str, Any]) -> str:
    body = {k: v for k, v in entry.items() if k != "hash"}
    return blake3(dumps_canonical(body)).hexdigest()


def _last_entry(fd: int, path: Path) -> dict[str, Any] | None:
    size = os.fstat(fd).st_size
    if size == 0:
        return None
    start = max(0, size - _TAIL_BYTES)
    tail = os.pread(fd, size - start, start)
    try:
        if not tail.endswith(b"\n"):
            raise ValueError("the last entry is cut off")
        entry = json.loads(tail.rstrip(b"\n").split(b"\n")[-1])
        if (
            not isinstance(entry, dict)
            or not isinstance(entry.get("seq"), int)
            or "hash" not in entry
        ):
            raise ValueError("the last line is not an audit entry")
    except ValueError as exc:
        raise AuditError(
            f"audit log {path} is damaged ({exc}); nothing more can be chained to it. Run "
            "`ckptvault audit verify` on it, keep it as evidence, and point audit_log= at a new file"
        ) from exc
    return entry


class AuditLog:
    def __init__(self, path: str | os.PathLike[str], ledger: Ledger | None) -> None:
        self.path = Path(os.path.realpath(os.fspath(path)))
        self.ledger = ledger

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise AuditError(f"cannot open audit log {self.path}: {exc.strerror or exc}") from exc
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            last = _last_entry(fd, self.path)
            entry: dict[str, Any] = {
                "seq": 0 if last is None else int(last["seq"]) + 1,
                "time": utc_now(),
                "event": event,
                **fields,
                "prev": GENESIS if last is None else last["hash"],
            }
            entry["hash"] = entry_hash(entry)
            os.write(fd, dumps_canonical(entry) + b"\n")
            os.fsync(fd)
            if self.ledger is not None:
                self.ledger.set_audit_head(str(self.path), entry["seq"] + 1, entry["hash"])
        finally:
            os.close(fd)  # releases the lock
        return entry


@dataclass
class AuditReport:
    path: str
    entries: int = 0
    problems: list[str] = field(default_factory=list)
    head_checked: bool = False

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_audit_log(path: str | os.PathLike[str], ledger: Ledger | None) -> AuditReport:
    """Check every link of the chain, and the tail against the ledger's head."""
    log = Path(os.path.realpath(os.fspath(path)))
    report = AuditReport(str(log))
    data = log.read_bytes()
    if data and not data.endswith(b"\n"):
        report.problems.append("the last entry is cut off (no newline at the end of the log)")
    previous = GENESIS
    for index, line in enumerate(data.split(b"\n")[:-1] if data else []):
        try:
            entry = json.loads(line)
            if not isinstance(entry, dict):
                raise ValueError("not an object")
        except ValueError:
            report.problems.append(f"line {index + 1} is not a JSON audit entry")
            previous = "?"
            report.entries += 1
            continue
        if entry.get("seq") != index:
            report.problems.append(
                f"line {index + 1} has seq {entry.get('seq')} (entries were removed or reordered)"
            )
        if entry.get("prev") != previous:
            report.problems.append(
                f"line {index + 1} does not follow the previous entry (chain broken)"
            )
        if entry.get("hash") != entry_hash(entry):
            report.problems.append(
                f"line {index + 1} (seq {entry.get('seq')}) was edited: its hash does not match"
            )
        previous = entry.get("hash", "?")
        report.entries += 1
    head = ledger.audit_head(str(log)) if ledger is not None else None
    if head is not None:
        report.head_checked = True
        count, last_hash = head
        if report.entries < count:
            report.problems.append(
                f"the log has {report.entries} entries but the ledger recorded {count}: "
                "its tail was cut off"
            )
        else:
            if report.entries > count:
                report.problems.append(
                    f"the log has {report.entries - count} entries after the head the ledger "
                    f"recorded (entry {count}): they were appended without the ledger"
                )
            lines = data.split(b"\n")
            try:
                recorded = json.loads(lines[count - 1]).get("hash") if count else GENESIS
            except (ValueError, IndexError, AttributeError):
                recorded = None
            if count and recorded != last_hash:
                report.problems.append(f"entry {count} differs from the head the ledger recorded")
    return report
