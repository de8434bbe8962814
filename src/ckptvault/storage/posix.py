"""A store on a POSIX filesystem, with atomic, durable publish.

Layout of a store directory::

    <store>/
      step-000000000100.<generation id>/   published generations (immutable)
        manifest.json                      written last
        r00000-000.safetensors ...
      .staging/<generation id>/            saves in progress or left by a crash
      .writer.lock                         the single-writer lock

Publishing a generation: every file is fsync'd as it is closed; the manifest is
written and fsync'd last; the staging directory is fsync'd; it is renamed to its
final name (same filesystem, so the rename is atomic); the store directory is
fsync'd. A crash at any point leaves either the old set of generations or the old
set plus the complete new one; a staging directory is never taken for a generation.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ckptvault.errors import CheckpointError, SaveFailedError, StorageFullError, UsageError
from ckptvault.format.layout import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    STAGING_DIR,
    WRITER_LOCK,
    generation_dirname,
    parse_generation_dirname,
)
from ckptvault.storage.base import EntryInfo, GenerationRef
from ckptvault.storage.lock import WriterLock

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
WRITE_BEHIND_BYTES = 8 * 1024 * 1024


def _load_sync_file_range() -> Callable[[int, int, int], None] | None:
    """``sync_file_range(SYNC_FILE_RANGE_WRITE)`` where the C library has it: start
    writing dirty pages back now, without waiting, so the disk works while the CPU
    hashes the next piece and the final fsync has little left to do."""
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int

    def start_writeback(fd: int, offset: int, count: int) -> None:
        function(fd, offset, count, 2)  # SYNC_FILE_RANGE_WRITE; a failure only loses the hint

    return start_writeback


_start_writeback = _load_sync_file_range()


def translate_os_error(exc: OSError, what: str) -> CheckpointError:
    """Map an OS error during a save to a typed ckptvault error."""
    if exc.errno in _FULL_ERRNOS:
        return StorageFullError(
            f"{what}: the filesystem is full or over quota ({exc.strerror}). Nothing was "
            "published and earlier generations are intact; free space or keep fewer "
            "generations, then save again."
        )
    return SaveFailedError(f"{what}: {exc.strerror or exc} ({type(exc).__name__})")


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs_durable(path: Path) -> None:
    """``mkdir -p`` whose new entries survive a crash: fsync each new directory's parent."""
    missing = []
    current = path
    while not current.exists():
        missing.append(current)
        current = current.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            continue
        fsync_directory(directory.parent)


class PosixWritableFile:
    """An unbuffered file in a staging directory; ``commit`` makes it durable."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644
        )
        self._written = 0
        self._flushed = 0  # bytes already handed to write-behind

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        written = 0
        try:
            while written < len(view):
                written += os.write(self._fd, view[written:])
        except OSError as exc:
            raise translate_os_error(exc, f"writing {self.path}") from exc
        self._written += written
        if _start_writeback is not None and self._written - self._flushed >= WRITE_BEHIND_BYTES:
            _start_writeback(self._fd, self._flushed, self._written - self._flushed)
            self._flushed = self._written
        return written

    def commit(self) -> None:
        try:
            # Published files are read-only: a generation is never modified.
            os.fchmod(self._fd, 0o444)
            os.fsync(self._fd)
        except OSError as exc:
            raise translate_os_error(exc, f"syncing {self.path}") from exc
        finally:
            self._close()

    def abort(self) -> None:
        self._close()

    def _close(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


class PosixStagingArea:
    def __init__(self, store: PosixStore, generation_id: str) -> None:
        self.store = store
        self.generation_id = generation_id
        self.path = store.staging_root / generation_id
        self.path.mkdir(mode=0o755)

    def create_file(self, name: str) -> PosixWritableFile:
        return PosixWritableFile(self.path / name)

    def publish(self, step: int, manifest: bytes, signature: bytes | None = None) -> GenerationRef:
        final = self.store.root / generation_dirname(step, self.generation_id)
        try:
            for name, data in ((MANIFEST_NAME, manifest), (SIGNATURE_NAME, signature)):
                if data is None:
                    continue
                small_file = PosixWritableFile(self.path / name)
                try:
                    small_file.write(data)
                except BaseException:
                    small_file.abort()
                    raise
                small_file.commit()
            fsync_directory(self.path)
            os.rename(self.path, final)
            fsync_directory(self.store.root)
            fsync_directory(self.store.staging_root)
        except OSError as exc:
            raise translate_os_error(exc, f"publishing {final}") from exc
        name = parse_generation_dirname(final.name)
        assert name is not None
        return GenerationRef(name=name, location=str(final))

    def abort(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


class PosixStore:
    """A checkpoint store rooted at a local directory (created on first save)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.abspath(os.fspath(root)))
        self.location = str(self.root)
        self.staging_root = self.root / STAGING_DIR
        self._lock = WriterLock(self.root / WRITER_LOCK, self.location)

    # -- reading ---------------------------------------------------------------------

    def exists(self) -> bool:
        return self.root.is_dir()

    def list_generations(self) -> list[GenerationRef]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        refs = []
        for entry in names:
            parsed = parse_generation_dirname(entry)
            if parsed is not None:
                refs.append(GenerationRef(name=parsed, location=str(self.root / entry)))
        refs.sort(key=lambda ref: ref.name, reverse=True)
        return refs

    def generation_kind(self, ref: GenerationRef) -> str:
        return _kind(os.lstat(self._path(ref)).st_mode)

    def list_entries(self, ref: GenerationRef) -> dict[str, EntryInfo]:
        entries = {}
        with os.scandir(self._path(ref)) as scan:
            for entry in scan:
                info = entry.stat(follow_symlinks=False)
                entries[entry.name] = EntryInfo(
                    name=entry.name,
                    size=info.st_size,
                    kind=_kind(info.st_mode),
                    links=info.st_nlink,
                )
        return entries

    def open_file(self, ref: GenerationRef, name: str) -> BinaryIO:
        fd = os.open(self._path(ref) / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        return os.fdopen(fd, "rb", buffering=0)

    def read_bytes(self, ref: GenerationRef, name: str, limit: int) -> bytes:
        with self.open_file(ref, name) as stream:
            data = stream.read(limit + 1)
        if len(data) > limit:
            raise OSError(errno.EFBIG, f"{name} is larger than {limit} bytes")
        return data

    def _path(self, ref: GenerationRef) -> Path:
        return self.root / ref.name.dirname

    # -- writing ---------------------------------------------------------------------

    def acquire_writer(self) -> None:
        try:
            make_dirs_durable(self.root)
        except OSError as exc:
            raise translate_os_error(exc, f"creating store {self.root}") from exc
        self._lock.acquire()

    def release_writer(self) -> None:
        self._lock.release()

    def remove_stale_staging(self) -> list[str]:
        if not self._lock.held:
            raise UsageError(
                "removing staging leftovers needs the writer lock; call acquire_writer() first"
            )
        try:
            stale = sorted(os.listdir(self.staging_root))
        except FileNotFoundError:
            return []
        for name in stale:
            path = self.staging_root / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        return stale

    def begin_generation(self, generation_id: str) -> PosixStagingArea:
        try:
            if not self.staging_root.is_dir():
                self.staging_root.mkdir(mode=0o755, exist_ok=True)
                fsync_directory(self.root)
            return PosixStagingArea(self, generation_id)
        except OSError as exc:
            raise translate_os_error(exc, f"creating a staging area in {self.root}") from exc


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISLNK(mode):
        return "symlink"
    if stat.S_ISDIR(mode):
        return "dir"
    return "other"
