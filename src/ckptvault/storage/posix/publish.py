"""Writing and publishing a generation on a POSIX filesystem.

A :class:`PosixStagingArea` is ``.staging/<generation id>/``, held open by
descriptor while its files are written. :class:`AtomicRename` is the POSIX
publish rule: the manifest (and signature) are written and fsync'd last, then the
staging directory, then it is renamed to its final name (same filesystem, so the
rename is atomic) and the store directory is fsync'd. A crash at any point leaves
either the old set of generations or the old set plus the complete new one.
"""

from __future__ import annotations

import contextlib
import os
from typing import Protocol

from ckptvault.errors import UsageError
from ckptvault.format.layout import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    STAGING_DIR,
    generation_dirname,
    parse_generation_dirname,
)
from ckptvault.storage.base import GenerationRef, write_new_file
from ckptvault.storage.posix.files import (
    PosixRoot,
    PosixWritableFile,
    open_dir,
    opened,
    read_small_file,
    remove_tree,
    translate_os_error,
)


class PosixPublishRule(Protocol):
    """How a staged generation becomes visible (:class:`AtomicRename`)."""

    def publish(
        self, area: PosixStagingArea, step: int, manifest: bytes, signature: bytes | None
    ) -> GenerationRef: ...


class PosixStagingRoot(PosixRoot, Protocol):
    """A POSIX store as its staging areas see it: a root with a publish rule."""

    @property
    def publish_rule(self) -> PosixPublishRule: ...


class PosixStagingArea:
    """``.staging/<generation id>/``, held open by descriptor while it is written."""

    def __init__(self, store: PosixStagingRoot, generation_id: str, joined: bool = False) -> None:
        self.store = store
        self.generation_id = generation_id
        self.location = os.path.join(store.location, STAGING_DIR, generation_id)
        # Joined: another rank began it; this one only adds files and removes its own.
        self.joined = joined
        self._created: list[str] = []
        self.staging_fd = store.open_staging_dir()
        try:
            if not joined:
                os.mkdir(generation_id, 0o755, dir_fd=self.staging_fd)
            self.fd = open_dir(generation_id, self.staging_fd, self.location)
        except BaseException:
            os.close(self.staging_fd)
            raise
        self._open = True

    def create_file(self, name: str) -> PosixWritableFile:
        self._check_open()
        self._created.append(name)
        return PosixWritableFile(self.fd, name, os.path.join(self.location, name))

    def adopt(self, names: list[str]) -> None:
        """Nothing to do: the other ranks' files are in this directory already."""

    def read_staged(self, name: str, limit: int) -> bytes:
        self._check_open()
        return read_small_file(self.fd, name, limit)

    def release(self) -> None:
        self._close()  # the directory descriptors; the files stay

    def publish(self, step: int, manifest: bytes, signature: bytes | None = None) -> GenerationRef:
        self._check_open()
        if self.joined:
            raise UsageError(f"{self.location}: only the rank that began a save publishes it")
        ref = self.store.publish_rule.publish(self, step, manifest, signature)
        self._close()  # on failure the caller aborts, which removes what was written
        return ref

    def abort(self) -> None:
        if self._open:
            try:
                # Best effort: what stays is removed as a leftover by the next save.
                if self.joined:
                    for name in self._created:
                        with contextlib.suppress(OSError):
                            os.unlink(name, dir_fd=self.fd)
                else:
                    remove_tree(self.staging_fd, self.generation_id)
            finally:
                self._close()

    def _check_open(self) -> None:
        # Its descriptors are closed (their numbers may already name another store's
        # directories): a finished area must never write anywhere.
        if not self._open:
            raise UsageError(f"staging area {self.location} was already published or aborted")

    def _close(self) -> None:
        if self._open:
            self._open = False
            fd, staging_fd, self.fd, self.staging_fd = self.fd, self.staging_fd, -1, -1
            os.close(fd)
            os.close(staging_fd)


class AtomicRename:
    """The POSIX publish rule: manifest last, fsync, rename into place, fsync the parent."""

    def publish(
        self, area: PosixStagingArea, step: int, manifest: bytes, signature: bytes | None
    ) -> GenerationRef:
        final = generation_dirname(step, area.generation_id)
        where = os.path.join(area.store.location, final)
        try:
            for file_name, data in ((MANIFEST_NAME, manifest), (SIGNATURE_NAME, signature)):
                if data is not None:
                    write_new_file(area, file_name, data)
            os.fsync(area.fd)
            with opened(area.store.open_root()) as root_fd:
                os.rename(area.generation_id, final, src_dir_fd=area.staging_fd, dst_dir_fd=root_fd)
                os.fsync(root_fd)
            os.fsync(area.staging_fd)
        except OSError as exc:
            raise translate_os_error(exc, f"publishing {where}") from exc
        name = parse_generation_dirname(final)
        assert name is not None  # generation_dirname always parses
        return GenerationRef(name=name, location=where)
