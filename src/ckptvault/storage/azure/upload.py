"""Writing one data blob: staged blocks uploaded in parallel, committed once.

An :class:`AzureWritableFile` buffers what it is given until it holds one block,
then hands the block to the store's
:class:`~ckptvault.storage.objects.uploads.PartUploader` (at most
``max_concurrency`` blocks in flight per store) and buffers the next.

- A file smaller than one block goes up with a single Put Blob; larger files as
  staged blocks (invisible, uncommitted) made into the blob by one Put Block List on
  ``commit``. Both carry ``If-None-Match: *``: an existing blob is never
  overwritten, so no save attempt can replace a published generation's bytes.
- Every block carries its MD5, which the service checks on arrival.
- Block sizes grow by themselves (doubling every 5,000 blocks, at most 4000 MiB),
  so a file of unknown size never needs Azure's 50,001st block.
- ``abort`` waits for blocks still in flight, then discards the staged blocks
  (:meth:`~ckptvault.storage.azure.client.AzureClient.discard_uncommitted`); a killed
  writer's blocks are removed by ``gc --stale-after``, and Azure drops uncommitted
  blocks by itself after a week.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, wait

from ckptvault.errors import SaveFailedError, UsageError
from ckptvault.storage.azure.client import AzureClient, AzureError
from ckptvault.storage.azure.options import MAX_BLOCK_SIZE
from ckptvault.storage.objects.uploads import PartUploader

logger = logging.getLogger("ckptvault")

MAX_BLOCKS = 50_000  # Azure: committed blocks per blob
BLOCKS_PER_DOUBLING = 5_000


def block_size_for(index: int, first_block_size: int) -> int:
    """The size of block ``index`` (0-based): the first size, doubled every 5,000
    blocks, at most 4000 MiB. Only the last block of a file may be smaller."""
    return min(first_block_size << min(index // BLOCKS_PER_DOUBLING, 32), MAX_BLOCK_SIZE)


class AzureWritableFile:
    """One new blob of a staging area; see the module docstring."""

    def __init__(
        self,
        client: AzureClient,
        uploader: PartUploader,
        key: str,
        first_block_size: int,
        on_commit: Callable[[str], None],
    ) -> None:
        self._client = client
        self._uploader = uploader
        self.key = key
        self._first_block_size = first_block_size
        self._on_commit = on_commit
        self._buffer = bytearray()
        self._blocks: list[Future[dict[str, object]]] = []
        self._failure: BaseException | None = None
        self._state = "open"  # then "committed" or "aborted"

    @property
    def url(self) -> str:
        return self._client.url(self.key)

    @property
    def is_open(self) -> bool:
        return self._state == "open"

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._check_writable()
        view = memoryview(data).cast("B")
        total = len(view)
        while len(view):
            size = block_size_for(len(self._blocks), self._first_block_size)
            room = size - len(self._buffer)
            self._buffer += view[:room]
            view = view[room:]
            if len(self._buffer) >= size:
                self._send_block()
        return total

    def commit(self) -> None:
        """Upload what is buffered and wait until the blob exists (committed)."""
        self._check_writable()
        try:
            if not self._blocks:
                self._client.put_new(self.key, self._buffer)
            else:
                if self._buffer:
                    self._send_block()
                for future in self._blocks:
                    future.result()
                self._client.commit_blocks(self.key, len(self._blocks))
        except BaseException as exc:
            self._state = "aborted"
            self._abandon()
            if isinstance(exc, AzureError):
                raise self._failed(exc) from exc
            raise
        self._state = "committed"
        self._buffer = bytearray()
        self._on_commit(self.key)

    def abort(self) -> None:
        """Drop the file: nothing of it stays (a committed file is the area's to delete)."""
        if self._state == "open":
            self._state = "aborted"
            self._abandon()

    def _check_writable(self) -> None:
        if self._state != "open":
            raise UsageError(f"{self.url} was already {self._state}; it takes no more bytes")
        failure = self._failure
        if failure is not None:
            self.abort()
            if isinstance(failure, AzureError):
                raise self._failed(failure) from failure
            raise SaveFailedError(f"uploading {self.url}: {failure!r}") from failure

    def _send_block(self) -> None:
        index = len(self._blocks)
        if index >= MAX_BLOCKS:
            raise SaveFailedError(
                f"{self.url} needs more than {MAX_BLOCKS} blocks of up to "
                f"{MAX_BLOCK_SIZE} bytes; raise the block size"
            )
        body, self._buffer = self._buffer, bytearray()

        def upload() -> dict[str, object]:
            self._client.stage_block(self.key, index, body)
            return {}

        future = self._uploader.submit(upload)
        future.add_done_callback(self._note_failure)
        self._blocks.append(future)

    def _note_failure(self, future: Future[dict[str, object]]) -> None:
        if self._failure is None and not future.cancelled() and future.exception() is not None:
            self._failure = future.exception()

    def _abandon(self) -> None:
        """Forget the buffer; discard the staged blocks once none is in flight."""
        self._buffer = bytearray()
        if not self._blocks:
            return
        wait(self._blocks)
        try:
            self._client.discard_uncommitted(self.key)
        except AzureError as exc:
            logger.warning(
                "could not discard the staged blocks of %s (%s); `ckptvault gc --stale-after` "
                "removes them later (and Azure after a week)",
                self.url,
                exc,
            )

    def _failed(self, exc: AzureError) -> SaveFailedError:
        if exc.errno == 17:  # EEXIST: a condition refused the write
            what = "the blob already exists (a generation id was reused?); nothing is overwritten"
        else:
            what = str(exc)
        return SaveFailedError(
            f"uploading {self.url}: {what}. Nothing was published; earlier generations are intact"
        )
