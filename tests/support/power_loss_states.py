"""Simulated power loss, part 2: what a disk may hold when power fails at a point.

Given the world before a save (:class:`power_loss.Tree`) and the save's log, the
state after power failed with the first ``k`` operations done is built for every
``k`` (every point, not a sample) by a conservative model of POSIX (ext4-like)
durability:

- a file's bytes and mode are durable once the file was fsync'd; bytes written
  since may be lost entirely, or torn (cut short, a page zeroed);
- a directory entry (create, mkdir, link, unlink, rmdir) is durable once its
  directory was fsync'd; until then it may be undone;
- a rename is durable once the destination directory was fsync'd (the journal
  commits it whole); fsync of the source alone makes only the old name's removal
  durable, so the entry may be lost from both places. A rename never leaves both
  names: rename(2) is atomic on every filesystem ckptvault supports;
- the ledger is the state of its last commit.

Each point is explored in several variants (:data:`CI_VARIANTS`; the long budget
adds :data:`LONG_VARIANTS`): everything not durable lost; entries lost but data
kept; entries kept but data torn; each pending entry change undone on its own; and
more. Identical states reached at several points are built once.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from support.power_loss import (
    ROOT,
    AddName,
    Chmod,
    LedgerCommit,
    Op,
    RemoveName,
    Sync,
    Tree,
    Truncate,
    Write,
    describe_tree,
)

PAGE = 4096
CI_VARIANTS = ("lost", "names lost", "kept", "torn half", "torn page", "undo each")
LONG_VARIANTS = ("undo each, data lost", "only each", "journal prefixes", "torn last page")


@dataclass(frozen=True)
class CrashState:
    point: int  # operations of the log that happened before the power failed
    variant: str
    tree: Tree
    ledger: bytes | None

    def fingerprint(self) -> str:
        """Equal for states that build identical trees and ledgers."""
        digest = hashlib.blake2b(self.ledger or b"")
        for path, (kind, mode, data, group) in sorted(describe_tree(self.tree).items()):
            digest.update(repr((path, kind, mode, group, len(data))).encode())
            digest.update(hashlib.blake2b(data).digest())
        return digest.hexdigest()


class Timeline:
    """Walks a log op by op, tracking what is durable and what may still be lost."""

    def __init__(self, base: Tree, base_ledger: bytes | None, log: list[Op]) -> None:
        self.base, self.log = base, log
        self.data = {inode: bytearray(data) for inode, data in base.data.items()}
        self.synced = dict(base.data)
        self.modes = dict(base.modes)
        self.synced_modes = dict(base.modes)
        self.last_sync: dict[int, int] = {}
        self.ledger = base_ledger
        self.meta: list[tuple[int, AddName | RemoveName]] = []
        self.rename_target: dict[int, int] = {}  # rename id -> destination directory
        self.point = 0

    def advance(self) -> None:
        """Apply the next operation of the log."""
        index, op = self.point, self.log[self.point]
        self.point += 1
        if isinstance(op, (AddName, RemoveName)):
            self.meta.append((index, op))
            if isinstance(op, AddName):
                if op.kind is not None:
                    self.modes[op.inode] = self.synced_modes[op.inode] = op.mode
                    if op.kind == "file":
                        self.data[op.inode], self.synced[op.inode] = bytearray(), b""
                if op.rename is not None:
                    self.rename_target[op.rename] = op.directory
        elif isinstance(op, Write):
            data = self.data[op.inode]
            if len(data) < op.offset:
                data.extend(bytes(op.offset - len(data)))
            data[op.offset : op.offset + len(op.data)] = op.data
        elif isinstance(op, Truncate):
            data = self.data[op.inode]
            del data[op.size :]
            data.extend(bytes(op.size - len(data)))
        elif isinstance(op, Chmod):
            self.modes[op.inode] = op.mode
        elif isinstance(op, Sync):
            self.last_sync[op.inode] = index
            if op.inode in self.data:
                self.synced[op.inode] = bytes(self.data[op.inode])
                self.synced_modes[op.inode] = self.modes[op.inode]
        elif isinstance(op, LedgerCommit):
            self.ledger = op.data

    # -- entries ------------------------------------------------------------------------

    def durable(self, index: int, op: AddName | RemoveName) -> bool:
        if self.last_sync.get(op.directory, -1) > index:
            return True
        if isinstance(op, RemoveName) and op.rename is not None:
            return self.last_sync.get(self.rename_target.get(op.rename, -1), -1) > index
        return False

    def pending(self) -> list[int]:
        """Indices of the entry changes so far that are not durable yet."""
        return [index for index, op in self.meta if not self.durable(index, op)]

    def entries(self, kept: set[int]) -> dict[int, dict[str, int]]:
        """Directory entries with every durable change and the pending ones in ``kept``
        (the old half of a kept rename's new name is kept with it)."""
        kept = set(kept)
        removal = {
            op.rename: i
            for i, op in self.meta
            if isinstance(op, RemoveName) and op.rename is not None
        }
        for index, op in self.meta:
            if index in kept and isinstance(op, AddName) and op.rename is not None:
                kept.add(removal[op.rename])
        entries = {d: dict(names) for d, names in self.base.entries.items()}
        for _, op in self.meta:
            if isinstance(op, AddName) and op.kind == "dir":
                entries.setdefault(op.inode, {})
        for index, op in self.meta:
            if not (index in kept or self.durable(index, op)):
                continue
            if isinstance(op, AddName):
                entries[op.directory][op.name] = op.inode
            elif entries[op.directory].get(op.name) == op.inode:
                del entries[op.directory][op.name]
        return entries

    # -- data ---------------------------------------------------------------------------

    def files(self, how: str) -> tuple[dict[int, bytes], dict[int, int]]:
        """Every file's bytes and every inode's mode: ``synced``, ``current`` or torn
        (``torn half``, ``torn page``, ``torn last page``)."""
        if how == "synced":
            return dict(self.synced), dict(self.synced_modes)
        data = {inode: bytes(current) for inode, current in self.data.items()}
        if how != "current":
            for inode, current in data.items():
                data[inode] = torn(self.synced[inode], current, how)
        return data, dict(self.modes)

    def state(self, variant: str, kept: set[int], how: str) -> CrashState:
        data, modes = self.files(how)
        entries = self.entries(kept)
        tree = Tree(entries=entries, data=data, modes=modes)
        return CrashState(self.point, variant, tree, self.ledger)


def torn(synced: bytes, current: bytes, how: str) -> bytes:
    """``current`` as a crash may leave it when only ``synced`` was durable."""
    if synced == current:
        return current
    first = next(
        (i for i, (a, b) in enumerate(zip(synced, current, strict=False)) if a != b),
        min(len(synced), len(current)),
    )
    if how == "torn half":
        return current[: first + (len(current) - first) // 2]
    # Zeros where the file grew but its page never reached the disk: only bytes not
    # yet durable, in the first page they touch (or the last page of the file).
    page = first // PAGE if how == "torn page" else max(first, len(current) - 1) // PAGE
    start, end = max(first, page * PAGE), min(len(current), (page + 1) * PAGE)
    return current[:start] + bytes(end - start) + current[end:]


def variants_at(timeline: Timeline, names: tuple[str, ...]) -> Iterator[CrashState]:
    """The crash states of one point, for each variant in ``names``."""
    pending = timeline.pending()
    everything = set(pending)
    simple = {
        "lost": (set(), "synced"),
        "names lost": (set(), "current"),
        "kept": (everything, "current"),
        "torn half": (everything, "torn half"),
        "torn page": (everything, "torn page"),
        "torn last page": (everything, "torn last page"),
    }
    for name in names:
        if name in simple:
            kept, how = simple[name]
            yield timeline.state(name, kept, how)
        elif name.startswith("undo each"):
            how = "synced" if name.endswith("data lost") else "current"
            for index in pending:
                yield timeline.state(f"undo #{index}", everything - {index}, how)
        elif name == "only each":
            for index in pending:
                yield timeline.state(f"only #{index}", {index}, "current")
        elif name == "journal prefixes":
            for count in range(1, len(pending)):
                yield timeline.state(f"first {count} entries", set(pending[:count]), "current")


def crash_states(
    base: Tree, base_ledger: bytes | None, log: list[Op], names: tuple[str, ...]
) -> Iterator[CrashState]:
    """Every point of ``log`` (0 to all of it), each in every variant of ``names``."""
    timeline = Timeline(base, base_ledger, log)
    while True:
        yield from variants_at(timeline, names)
        if timeline.point == len(log):
            return
        timeline.advance()


def replay_all(base: Tree, log: list[Op]) -> Tree:
    """The tree with every operation of ``log`` kept (a clean shutdown)."""
    timeline = Timeline(base, None, log)
    while timeline.point < len(log):
        timeline.advance()
    return timeline.state("kept", set(timeline.pending()), "current").tree


def materialize(tree: Tree, target: Path) -> None:
    """Build ``tree`` at ``target`` (which must not exist): directories, files, modes
    and hard links. A directory reachable twice is built once."""
    built: dict[int, Path] = {}
    directories: list[tuple[Path, int]] = []

    def build(inode: int, path: Path) -> None:
        if inode in built:
            if inode not in tree.entries:
                os.link(built[inode], path)
            return
        built[inode] = path
        if inode in tree.entries:
            path.mkdir()
            directories.append((path, tree.modes[inode]))
            for name, child in sorted(tree.entries[inode].items()):
                build(child, path / name)
        else:
            path.write_bytes(tree.data[inode])
            path.chmod(tree.modes[inode])

    build(ROOT, target)
    for path, mode in reversed(directories):  # children first: a 0500 parent comes last
        path.chmod(mode)
