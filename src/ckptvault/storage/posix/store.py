"""A store on a POSIX filesystem, with atomic, durable publish.

Layout of a store directory::

    <store>/
      step-000000000100.<generation id>/   published generations (immutable)
        manifest.json                      written last
        r00000-000.safetensors ...
      .staging/<generation id>/            saves in progress or left by a crash
      .writer.lock                         the single-writer lock

Publishing a generation (:class:`AtomicRename`): every file is fsync'd as it is
closed; the manifest is written and fsync'd last; the staging directory is fsync'd;
it is renamed to its final name (same filesystem, so the rename is atomic); the
store directory is fsync'd. A crash at any point leaves either the old set of
generations or the old set plus the complete new one; a staging directory is never
taken for a generation.

Whoever can write the store may plant links and special files in it. So every entry
below the store's root is opened relative to a directory descriptor with
``O_NOFOLLOW`` and checked with ``fstat`` after opening: a symlinked ``.staging`` or
``.writer.lock`` is never followed out of the store, a FIFO never blocks a reader,
and cleanup deletes only what lies inside the store. (The root itself is the path
the user chose, and may be a symlink.)

The publish rule and staging area are in :mod:`~ckptvault.storage.posix.publish`,
removing leftovers and deleting generations in :mod:`~ckptvault.storage.posix.cleanup`,
records in :mod:`~ckptvault.storage.posix.records`, the descriptor-safe file
primitives in :mod:`~ckptvault.storage.posix.files`. This module ties them into a
:class:`~ckptvault.storage.base.Store`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from io import FileIO
from pathlib import Path
from typing import Any

import ckptvault.storage.posix.cleanup as posix_cleanup
import ckptvault.storage.posix.records as posix_records
from ckptvault.durable import make_dirs_durable
from ckptvault.errors import StorageFullError, UnsafeEntryError, UsageError
from ckptvault.format.layout import (
    STAGING_DIR,
    WRITER_LOCK,
    is_generation_id,
    parse_generation_dirname,
)
from ckptvault.storage.base import EntryInfo, GenerationRef
from ckptvault.storage.lock import WriterLock
from ckptvault.storage.posix.files import (
    describe_unsafe,
    open_dir,
    opened,
    printable_name,
    translate_os_error,
)
from ckptvault.storage.posix.publish import AtomicRename, PosixStagingArea
from ckptvault.storage.posix.replace import replace_manifest_files
from ckptvault.storage.records import RecordFilter

__all__ = ["CAPACITY_HEADROOM", "AtomicRename", "PosixStagingArea", "PosixStore"]

logger = logging.getLogger("ckptvault")
CAPACITY_HEADROOM = 256 * 1024  # beyond 1/16 of the save: directory blocks, metadata


class PosixStore:
    """A checkpoint store rooted at a local directory (created on first save)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.abspath(os.fspath(root)))
        self.location = str(self.root)
        self.publish_rule = AtomicRename()
        self._lock = WriterLock(self._open_lock_file, self.location)

    # -- descriptors ----------------------------------------------------------------

    def open_root(self) -> int:
        return os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def _open_generation(self, ref: GenerationRef) -> int:
        with opened(self.open_root()) as root_fd:
            return open_dir(ref.name.dirname, root_fd, ref.location)

    def open_staging_dir(self) -> int:
        """``.staging``, created if missing; a link planted there is removed, not followed."""
        where = os.path.join(self.location, STAGING_DIR)
        with opened(self.open_root()) as root_fd:
            for _attempt in range(3):
                try:
                    return open_dir(STAGING_DIR, root_fd, where)
                except FileNotFoundError:
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(STAGING_DIR, 0o755, dir_fd=root_fd)
                        os.fsync(root_fd)
                except UnsafeEntryError:
                    os.unlink(STAGING_DIR, dir_fd=root_fd)  # removes the link itself only
        raise UnsafeEntryError(f"{where} keeps being replaced; ckptvault will not write there")

    def _open_lock_file(self) -> int:
        """``.writer.lock``, opened without following a link and checked after opening.

        A symlink, hard link or FIFO planted there is replaced, never written through:
        truncating the lock file must not truncate a key file it points at. (A lock in
        a directory the attacker can write cannot keep the attacker out anyway; it
        keeps honest writers apart.) A directory there is refused.
        """
        where = os.path.join(self.location, WRITER_LOCK)
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        with opened(self.open_root()) as root_fd:
            for _attempt in range(3):
                try:
                    fd = os.open(WRITER_LOCK, flags, 0o644, dir_fd=root_fd)
                except IsADirectoryError as exc:
                    raise UnsafeEntryError(
                        f"{where} is a directory, not ckptvault's lock file; remove it"
                    ) from exc
                except OSError as exc:
                    if exc.errno != errno.ELOOP:
                        raise
                    unsafe: str | None = "is a symlink"
                else:
                    unsafe = describe_unsafe(os.fstat(fd))
                    if unsafe is None:
                        return fd
                    os.close(fd)
                logger.warning("%s %s; replacing it with a fresh lock file", where, unsafe)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(WRITER_LOCK, dir_fd=root_fd)  # the link itself, never its target
        raise UnsafeEntryError(f"{where} keeps being replaced; ckptvault will not write there")

    # -- reading ---------------------------------------------------------------------

    def holds_path(self, path: Path) -> bool:
        resolved, root = Path(os.path.realpath(path)), Path(os.path.realpath(self.root))
        return resolved == root or root in resolved.parents

    def list_generations(self) -> list[GenerationRef]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        refs = []
        for entry in names:
            parsed = parse_generation_dirname(entry)
            if parsed is not None:
                refs.append(GenerationRef(name=parsed, location=os.path.join(self.location, entry)))
        refs.sort(key=lambda ref: ref.name, reverse=True)
        return refs

    def list_entries(self, ref: GenerationRef) -> dict[str, EntryInfo]:
        entries = {}
        with opened(self._open_generation(ref)) as fd:
            for name in os.listdir(fd):
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                shown = printable_name(name)
                if shown != name:  # never a name ckptvault writes: report it, escaped
                    entries[shown] = EntryInfo(
                        shown, info.st_size, "has a non-UTF-8 or control-character name"
                    )
                    continue
                entries[name] = EntryInfo(name, info.st_size, describe_unsafe(info))
        return entries

    def open_file(self, ref: GenerationRef, name: str) -> FileIO:
        where = os.path.join(ref.location, name)
        with opened(self._open_generation(ref)) as dir_fd:
            try:
                # O_NONBLOCK: a FIFO swapped in after listing must not hang the reader.
                fd = os.open(
                    name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd
                )
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise UnsafeEntryError(
                        f"{where} is a symlink; ckptvault does not follow it"
                    ) from exc
                raise
        unsafe = describe_unsafe(os.fstat(fd))
        if unsafe is not None:
            os.close(fd)
            raise UnsafeEntryError(f"{where} {unsafe}, not a plain file; refusing to read it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0)

    def read_range(self, ref: GenerationRef, name: str, offset: int, length: int) -> bytes:
        with self.open_file(ref, name) as stream:
            parts = []
            while length > 0:
                piece = os.pread(stream.fileno(), length, offset)
                if not piece:
                    break
                parts.append(piece)
                offset += len(piece)
                length -= len(piece)
        return b"".join(parts)

    def read_bytes(self, ref: GenerationRef, name: str, limit: int) -> bytes:
        with self.open_file(ref, name) as stream:
            size = os.fstat(stream.fileno()).st_size
            if size > limit:
                raise OSError(errno.EFBIG, f"{name} is larger than {limit} bytes")
            data = stream.read(size + 1)  # not limit + 1: read() reserves what it is asked
        if len(data) > min(size, limit):
            raise OSError(errno.EFBIG, f"{name} is larger than {limit} bytes")
        return data

    # -- writing ---------------------------------------------------------------------

    def acquire_writer(self) -> None:
        try:
            make_dirs_durable(self.root)
        except OSError as exc:
            raise translate_os_error(exc, f"creating store {self.root}") from exc
        self._lock.acquire()

    def release_writer(self) -> None:
        self._lock.release()

    def check_capacity(self, nbytes: int, nfiles: int) -> None:
        """Free bytes and inodes (as the writing user sees them) must cover the save
        plus headroom: 1/16 more bytes and 256 KiB, and a few more inodes."""
        try:
            info = os.statvfs(self.root)
        except OSError as exc:
            raise translate_os_error(exc, f"checking free space in {self.location}") from exc
        free = info.f_bavail * info.f_frsize
        needed = nbytes + nbytes // 16 + CAPACITY_HEADROOM
        free_inodes, needed_inodes = info.f_favail, nfiles + 8
        inodes_short = info.f_files > 0 and free_inodes < needed_inodes  # 0: no inode limit
        if free < needed or inodes_short:
            raise StorageFullError(
                f"store {self.location} has {free:,} bytes and {free_inodes:,} inodes free, "
                f"but this save needs about {needed:,} bytes ({nbytes:,} plus headroom) and "
                f"{needed_inodes} inodes. Nothing was written and earlier generations are "
                "intact; free space, or keep fewer generations "
                "(retention=cv.Retention(keep_last=...)), then save again"
            )

    def begin_generation(self, generation_id: str) -> PosixStagingArea:
        try:
            return PosixStagingArea(self, generation_id)
        except OSError as exc:
            raise translate_os_error(exc, f"creating a staging area in {self.root}") from exc

    def join_generation(self, generation_id: str) -> PosixStagingArea:
        if not is_generation_id(generation_id):
            raise UsageError(f"{generation_id!r} is not a generation id")
        try:
            return PosixStagingArea(self, generation_id, joined=True)
        except OSError as exc:
            raise translate_os_error(exc, f"joining staging area {generation_id}") from exc

    # -- lifecycle ---------------------------------------------------------------------

    def remove_stale_staging(self, older_than: float | None = None) -> list[str]:
        if older_than is None and not self._lock.held:
            raise UsageError(
                "removing every staging leftover needs the writer lock; call acquire_writer() "
                "first, or give older_than"
            )
        return posix_cleanup.remove_stale_staging(self, older_than)

    def delete_generation(self, ref: GenerationRef) -> None:
        """Out of the listing with one rename (into staging), then its bytes go."""
        posix_cleanup.delete_generation(self, ref)

    def replace_manifest(
        self, ref: GenerationRef, manifest: bytes, signature: bytes | None, *, replaces: bytes
    ) -> None:
        """Key rotation's one change to a published generation (see
        :mod:`ckptvault.storage.posix.replace`); needs the writer lock."""
        if not self._lock.held:
            raise UsageError(
                "replacing a manifest needs the writer lock; call acquire_writer() first"
            )
        with (
            opened(self._open_generation(ref)) as generation_fd,
            opened(self.open_staging_dir()) as staging_fd,
        ):
            replace_manifest_files(generation_fd, staging_fd, ref, manifest, signature, replaces)

    # -- records -----------------------------------------------------------------------

    def put_record(self, kind: str, name: str, data: dict[str, Any]) -> None:
        posix_records.put_record(self, kind, name, data)

    def list_records(
        self, kind: str, accept: RecordFilter | None = None, limit: int | None = None
    ) -> dict[str, dict[str, Any]]:
        return posix_records.list_records(self, kind, accept, limit)

    def delete_record(self, kind: str, name: str) -> None:
        posix_records.delete_record(self, kind, name)
