"""The staging area of an object store: one save attempt's objects, and their bookkeeping.

An object store has no staging directory: an attempt's files are objects under its
own ``data/<x>/<generation id>/`` prefixes (``objects.layout``), invisible as a
generation until its manifest is written. :class:`ObjectStagingArea` keeps what every
object store needs to know about its attempt — which files are still being written,
which objects it created (to delete them on abort, to lock them at publish), whether
it was published, aborted or let go — and leaves three things to its backend
(S3, Azure Blob): how a new file is written (:meth:`ObjectStagingArea._new_file`),
how the attempt's objects are deleted (:meth:`ObjectStagingArea._delete`) and its
publish rule (:meth:`ObjectStagingArea._publish`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Protocol

from ckptvault.errors import SaveFailedError, UsageError
from ckptvault.format.layout import is_generation_id
from ckptvault.storage.base import GenerationRef
from ckptvault.storage.objects.errors import ObjectStoreError

logger = logging.getLogger("ckptvault")


class StagedFile(Protocol):
    """A file being written into an object store's staging area."""

    @property
    def is_open(self) -> bool:
        """Neither committed nor aborted yet."""

    def write(self, data: bytes | bytearray | memoryview) -> int: ...

    def commit(self) -> None: ...

    def abort(self) -> None: ...


class ObjectStagingArea:
    """The objects of one save attempt (see the module docstring)."""

    def __init__(self, store: Any, generation_id: str, joined: bool = False) -> None:
        if not is_generation_id(generation_id):
            raise UsageError(f"{generation_id!r} is not a generation id")
        self.store = store
        self.generation_id = generation_id
        self.joined = joined  # another rank began it: this one never publishes
        self.location = f"{store.location}/data/*/{generation_id}"
        self._files: dict[str, StagedFile] = {}
        self._written: list[str] = []  # keys this attempt created, to delete on abort
        self._mutex = threading.Lock()
        self._state = "open"  # then "published", "aborted" or "released"
        self.keep_written = False  # the publish outcome is unknown: delete nothing

    # -- what a backend supplies --------------------------------------------------------

    def _new_file(self, key: str) -> StagedFile:
        """A writer of the new object ``key`` that calls :meth:`note_written` on commit."""
        raise NotImplementedError

    def _delete(self, keys: list[str]) -> None:
        """Delete ``keys`` (already missing is fine); ``ObjectStoreError`` on failure."""
        raise NotImplementedError

    def _publish(self, step: int, manifest: bytes, signature: bytes | None) -> GenerationRef:
        """The backend's publish rule: manifest last, conditionally."""
        raise NotImplementedError

    # -- the StagingArea protocol ---------------------------------------------------------

    def create_file(self, name: str) -> Any:
        key = self.store.layout.data_key(self.generation_id, name)
        with self._mutex:
            self._check_open()
            if name in self._files:
                raise UsageError(f"{name} was already created in {self.location}")
            new = self._new_file(key)
            self._files[name] = new
            return new

    def note_written(self, key: str) -> None:
        with self._mutex:
            self._written.append(key)

    def written_keys(self) -> list[str]:
        with self._mutex:
            return list(self._written)

    def unfinished_files(self) -> list[str]:
        with self._mutex:
            return sorted(name for name, file in self._files.items() if file.is_open)

    def release(self) -> None:
        """Nothing is held open between files; the written objects stay."""
        with self._mutex:
            if self._state == "open":
                self._state = "released"

    def adopt(self, names: list[str]) -> None:
        for name in names:
            self.note_written(self.store.layout.data_key(self.generation_id, name))

    def publish(self, step: int, manifest: bytes, signature: bytes | None = None) -> GenerationRef:
        with self._mutex:
            self._check_open()
        if self.joined:
            raise UsageError(f"{self.location}: only the rank that began a save publishes it")
        try:
            ref = self._publish(step, manifest, signature)
        except ObjectStoreError as exc:  # a request before the manifest's own failed
            self.abort()
            raise SaveFailedError(
                f"publishing {self.generation_id} into {self.store.location}: {exc}. Nothing "
                "was published; earlier generations are intact"
            ) from exc
        except BaseException:
            self.abort()
            raise
        with self._mutex:
            self._state = "published"
        return ref

    def abort(self) -> None:
        """Abort unfinished files and delete every object this attempt wrote."""
        with self._mutex:
            if self._state != "open":
                return
            self._state = "aborted"
            files, written = list(self._files.values()), list(self._written)
        for file in files:
            file.abort()
        if self.keep_written:
            return
        try:
            self._delete(written)
        except ObjectStoreError as exc:
            logger.warning(
                "could not delete what the aborted save %s wrote (%s); "
                "Store.remove_stale_staging removes it later",
                self.generation_id,
                exc,
            )

    def _check_open(self) -> None:
        if self._state != "open":
            raise UsageError(f"staging area {self.location} was already {self._state}")
