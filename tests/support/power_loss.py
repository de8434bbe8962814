"""Simulated power loss, part 1: recording what a save asks of the file system.

:class:`Recorder` swaps the ``os`` functions ckptvault writes with (``open``,
``write``, ``pwrite``, ``ftruncate``, ``fsync``, ``fchmod``, ``mkdir``, ``rename``,
``replace``, ``link``, ``unlink``, ``rmdir``, ...) for wrappers that call the real
function and then log what it did to a model of one directory tree (the "world":
store, key store, audit log), by inode, so that a descriptor keeps naming the same
directory after that directory is renamed. Names given relative to a directory
descriptor (``dir_fd=``) are resolved through the model like absolute ones.
Every module looks these functions up on ``os`` when it calls them, so patching
the module catches every caller, the store's worker threads included.

The log says which operations the disk may still forget: :mod:`power_loss_states`
turns any prefix of it into what a disk could hold after a power failure there.
The rollback ledger is SQLite (its writes never pass through Python's ``os``); a
committed transaction is durable when ``commit`` returns (``synchronous=FULL``), so
it is logged as a :class:`LedgerCommit` snapshot of the whole database after each
transaction that changed it.

Nothing may escape the log: :meth:`Recorder.check_complete` compares the model's
"everything kept" end state with the real tree (an operation the wrappers missed
shows up as a difference), and an operation the model cannot place is an error.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptvault.trust.ledger import Ledger

ROOT = 0  # the inode number of the world's root directory in the model


@dataclass(frozen=True)
class AddName:
    """``name`` in ``directory`` now names ``inode``: a create, mkdir, link, or the
    new half of a rename (``rename`` pairs it with its :class:`RemoveName`). ``kind``
    and ``mode`` are set when the inode is new."""

    directory: int
    name: str
    inode: int
    kind: str | None = None  # "file" or "dir" for a new inode
    mode: int = 0
    rename: int | None = None


@dataclass(frozen=True)
class RemoveName:
    """``name`` no longer names ``inode`` in ``directory`` (unlink, rmdir, the old
    half of a rename)."""

    directory: int
    name: str
    inode: int
    rename: int | None = None


@dataclass(frozen=True)
class Write:
    inode: int
    offset: int
    data: bytes


@dataclass(frozen=True)
class Truncate:
    inode: int
    size: int


@dataclass(frozen=True)
class Chmod:
    inode: int
    mode: int


@dataclass(frozen=True)
class Sync:
    """fsync of a file (its data and mode are durable) or of a directory (its
    entries are durable)."""

    inode: int


@dataclass(frozen=True)
class LedgerCommit:
    data: bytes


Op = AddName | RemoveName | Write | Truncate | Chmod | Sync | LedgerCommit


@dataclass
class Tree:
    """A world as inodes: directories' entries, files' bytes, every inode's mode."""

    entries: dict[int, dict[str, int]] = field(default_factory=dict)  # directories
    data: dict[int, bytes] = field(default_factory=dict)  # files
    modes: dict[int, int] = field(default_factory=dict)

    def kind(self, inode: int) -> str:
        return "dir" if inode in self.entries else "file"


def read_tree(root: Path) -> Tree:
    """The tree under ``root`` as it is on disk (hard links share an inode)."""
    tree = Tree()
    numbers: dict[int, int] = {}

    def visit(path: Path) -> int:
        info = os.lstat(path)
        if info.st_ino in numbers:
            return numbers[info.st_ino]
        inode = numbers[info.st_ino] = len(numbers)
        tree.modes[inode] = stat.S_IMODE(info.st_mode)
        if stat.S_ISDIR(info.st_mode):
            tree.entries[inode] = {name: visit(path / name) for name in sorted(os.listdir(path))}
        elif stat.S_ISREG(info.st_mode):
            tree.data[inode] = path.read_bytes()
        else:
            raise AssertionError(f"{path}: only directories and plain files are modelled")
        return inode

    assert visit(root) == ROOT
    return tree


def describe_tree(tree: Tree) -> dict[str, tuple[str, int, bytes, int]]:
    """Path -> (kind, mode, bytes, link group) of everything reachable from the root;
    the link group is the first path that named the inode (hard links agree)."""
    described: dict[str, tuple[str, int, bytes, int]] = {}
    first: dict[int, int] = {}

    def visit(inode: int, path: str) -> None:
        group = first.setdefault(inode, len(first))
        if inode in tree.entries:
            described[path] = ("dir", tree.modes[inode], b"", group)
            for name, child in sorted(tree.entries[inode].items()):
                visit(child, f"{path}/{name}")
        else:
            described[path] = ("file", tree.modes[inode], tree.data[inode], group)

    visit(ROOT, "")
    return described


class ModelError(AssertionError):
    """The model cannot place an operation the real file system accepted."""


class Recorder:
    """Records the file-system operations under ``world`` while :meth:`recording`."""

    def __init__(self, world: Path, ledger: Path | None = None) -> None:
        self.world = Path(os.path.realpath(world))
        self.ledger = Path(os.path.abspath(ledger)) if ledger is not None else None
        self.base = read_tree(self.world)
        self.base_ledger = self._ledger_bytes()
        self.log: list[Op] = []
        self.errors: list[str] = []
        # The live model: current entries and inode kinds, while recording.
        self._entries = {d: dict(names) for d, names in self.base.entries.items()}
        self._next_inode = max([*self.base.modes, ROOT]) + 1
        self._next_rename = 0
        self._fds: dict[int, int] = {}
        self._last_ledger = self.base_ledger
        self._lock = threading.RLock()
        self._real: dict[str, Callable[..., Any]] = {}

    def _ledger_bytes(self) -> bytes | None:
        if self.ledger is None or not self.ledger.exists():
            return None
        return self.ledger.read_bytes()

    # -- resolving names ------------------------------------------------------------

    def _start(self, path: Any, dir_fd: int | None) -> tuple[int, list[str]] | None:
        """The inode a path starts from and its components; None outside the world."""
        text = os.fsdecode(path)
        if dir_fd is not None and not os.path.isabs(text):
            if dir_fd not in self._fds:
                return None
            return self._fds[dir_fd], [p for p in text.split("/") if p not in ("", ".")]
        absolute = os.path.normpath(os.path.abspath(text))
        root = str(self.world)
        if absolute == root:
            return ROOT, []
        if not absolute.startswith(root + os.sep):
            return None
        return ROOT, absolute[len(root) + 1 :].split(os.sep)

    def _walk(self, inode: int, parts: list[str], what: str) -> int:
        for part in parts:
            if part == ".." or inode not in self._entries or part not in self._entries[inode]:
                raise ModelError(f"{what}: the model has no {part!r} in inode {inode}")
            inode = self._entries[inode][part]
        return inode

    def locate(self, path: Any, dir_fd: int | None) -> tuple[int, str] | None:
        """(directory inode, name) of a tracked path, or None outside the world."""
        start = self._start(path, dir_fd)
        if start is None:
            return None
        inode, parts = start
        if not parts:
            raise ModelError(f"{path}: the world's root has no name in the world")
        return self._walk(inode, parts[:-1], os.fsdecode(path)), parts[-1]

    def resolve(self, path: Any, dir_fd: int | None) -> int | None:
        start = self._start(path, dir_fd)
        return None if start is None else self._walk(*start, os.fsdecode(path))

    # -- applying to the live model -------------------------------------------------

    def _add(self, op: AddName) -> None:
        self._entries[op.directory][op.name] = op.inode
        if op.kind == "dir":
            self._entries[op.inode] = {}
        self.log.append(op)

    def _remove(self, directory: int, name: str, rename: int | None = None) -> int:
        inode = self._entries[directory].pop(name)
        self.log.append(RemoveName(directory, name, inode, rename))
        return inode

    def _new_inode(self) -> int:
        self._next_inode += 1
        return self._next_inode - 1

    def _mode_of(self, path: Any, dir_fd: int | None) -> int:
        info = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        return stat.S_IMODE(info.st_mode)

    # -- installing -------------------------------------------------------------------

    @contextlib.contextmanager
    def recording(self) -> Iterator[Recorder]:
        """Log every tracked operation until the block ends."""
        from support.power_loss_wrappers import wrappers

        replaced = wrappers(self)
        original_connect = Ledger._connect
        self._real = {name: getattr(os, name) for name in replaced}
        recorder = self

        @contextlib.contextmanager
        def connect(ledger: Ledger) -> Iterator[Any]:
            with original_connect(ledger) as db:
                yield db
            if recorder.ledger is not None and ledger.path == recorder.ledger:
                recorder.note_ledger()

        try:
            for name, wrapper in replaced.items():
                setattr(os, name, wrapper)
            Ledger._connect = connect  # type: ignore[method-assign]
            yield self
        finally:
            for name, real in self._real.items():
                setattr(os, name, real)
            Ledger._connect = original_connect  # type: ignore[method-assign]

    def note_ledger(self) -> None:
        """A ledger transaction committed (durably): snapshot it if it changed."""
        with self._lock:
            data = self._ledger_bytes()
            if data is not None and data != self._last_ledger:
                self._last_ledger = data
                self.log.append(LedgerCommit(data))

    def end_state(self) -> Tree:
        """The model with every operation kept (what a clean shutdown leaves)."""
        from support.power_loss_states import replay_all

        return replay_all(self.base, self.log)

    def check_complete(self) -> None:
        """Fail when the model's end state differs from the real tree: an operation
        escaped the log (or the model mis-applied one)."""
        assert not self.errors, "operations the model could not place:\n" + "\n".join(self.errors)
        modelled, real = describe_tree(self.end_state()), describe_tree(read_tree(self.world))
        if modelled != real:
            differ = sorted(
                path
                for path in modelled.keys() | real.keys()
                if modelled.get(path) != real.get(path)
            )
            raise AssertionError(f"the recorded log misses operations on: {differ[:20]}")
        if self.ledger is not None:
            assert self._ledger_bytes() == self._last_ledger, "a ledger commit escaped the log"
