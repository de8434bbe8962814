"""Verifying an audit log: every link of its hash chain, every recorded gap, and
its tail against the head the ledger keeps (``ckptvault audit verify``). An append a
crash cut short is judged as the next append will settle it (``settled``)."""

from __future__ import annotations

import bisect
import itertools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from blake3 import blake3

from ckptvault.trust.audit import (
    GAP_EVENT,
    GENESIS,
    as_count,
    describe_entries,
    describe_gap,
    entry_hash,
    parse_line,
    settled,
)
from ckptvault.trust.ledger import Ledger


@dataclass
class AuditReport:
    path: str
    entries: int = 0
    problems: list[str] = field(default_factory=list)
    head_checked: bool = False
    gaps: list[dict[str, Any]] = field(default_factory=list)  # each recorded gap, with its line

    @property
    def ok(self) -> bool:
        return not self.problems


def _evidence(data: bytes, offsets: list[int], index: int, gap: Mapping[str, Any]) -> range | None:
    """The lines that a gap entry on line ``index`` keeps, right before it, as evidence
    of a damaged tail; None when those bytes are not the ones it recorded. ``offsets``
    holds where each line starts."""
    size = as_count(gap.get("damaged_bytes"))
    if not size:
        return range(index, index)
    end = offsets[index]
    first = bisect.bisect_left(offsets, end - size)
    if first == len(offsets) or offsets[first] != end - size:
        return None  # the recorded size does not end on a line
    if blake3(data[end - size : end]).hexdigest() != gap.get("damaged_blake3"):
        return None
    return range(first, index)


def verify_audit_log(path: str | os.PathLike[str], ledger: Ledger | None) -> AuditReport:
    """Check every link of the chain, every recorded gap, and the tail against the
    ledger's head. A log that holds a gap entry never verifies."""
    log = Path(os.path.realpath(os.fspath(path)))
    report = AuditReport(str(log))
    data = log.read_bytes()
    head = ledger.audit_head(str(log)) if ledger is not None else None
    pending = ledger.audit_pending(str(log)) if ledger is not None else None
    if pending is not None:  # an append a crash cut short: what the next append keeps
        keep, head = settled(data, head, pending)
        data = data[:keep]
    if data and not data.endswith(b"\n"):
        report.problems.append("the last entry is cut off (no newline at the end of the log)")
    lines = data.split(b"\n")[:-1] if data else []
    offsets = list(itertools.accumulate((len(line) + 1 for line in lines[:-1]), initial=0))
    parsed = [parse_line(line) for line in lines]
    evidence = _recorded_evidence(report, data, offsets, parsed)
    hashes = _check_chain(report, parsed, evidence)
    report.entries = len(hashes)
    _check_head(report, hashes, head)
    return report


def _recorded_evidence(
    report: AuditReport, data: bytes, offsets: list[int], parsed: list[Any]
) -> set[int]:
    """Damaged lines that a gap entry right after them accounts for (kept as evidence)."""
    evidence: set[int] = set()
    for index, entry in enumerate(parsed):
        if isinstance(entry, dict) and entry.get("event") == GAP_EVENT:
            kept = _evidence(data, offsets, index, entry)
            if kept is None:
                report.problems.append(
                    f"line {index + 1} records a gap, but the damaged bytes before it are not "
                    "the ones it recorded: the evidence was changed"
                )
            else:
                evidence.update(kept)
    return evidence


def _check_chain(report: AuditReport, parsed: list[Any], evidence: set[int]) -> list[str]:
    """Every entry's position, link and hash; returns each entry's hash by position."""
    hashes: list[str] = []
    previous = GENESIS
    for index, entry in enumerate(parsed):
        if index in evidence:
            continue
        position = len(hashes)
        if not isinstance(entry, dict):
            report.problems.append(f"line {index + 1} is not a JSON audit entry")
            previous = "?"
            hashes.append("?")
            continue
        if entry.get("seq") != position:
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
        if entry.get("event") == GAP_EVENT:
            report.gaps.append({"line": index + 1, **entry})
            report.problems.append(
                f"line {index + 1} (seq {entry.get('seq')}, {entry.get('time')}) records a gap: "
                f"{describe_gap(entry)}. The ledger cannot vouch for the entries before it; keep "
                "the log as evidence and start a new one"
            )
        previous = str(entry.get("hash", "?"))
        hashes.append(previous)
    return hashes


def _check_head(report: AuditReport, hashes: list[str], head: tuple[int, str] | None) -> None:
    """The log's tail against the head the ledger recorded at the last append."""
    if head is None:
        return
    report.head_checked = True
    count, last_hash = head
    if report.entries < count:
        report.problems.append(
            f"the log has {report.entries} entries but the ledger recorded {count}: "
            f"its tail was cut off ({describe_entries(report.entries, count)} lost)"
        )
        return
    if report.entries > count:
        report.problems.append(
            f"the log has {report.entries - count} entries after the head the ledger "
            f"recorded (entry {count}): they were appended without the ledger"
        )
    if count and hashes[count - 1] != last_hash:
        report.problems.append(f"entry {count} differs from the head the ledger recorded")
