"""Writing one data object: buffered parts uploaded in parallel, with bounded memory.

A :class:`S3WritableFile` buffers what it is given until it holds one part, then
hands the part to the store's :class:`PartUploader` and buffers the next. The
uploader runs at most ``max_concurrency`` part uploads at once for the whole store
and makes writers wait for a free slot, so a save holds at most that many parts in
flight plus one filling buffer per open file, however large the checkpoint.

- A file smaller than one part goes up with a single ``PutObject``; larger files
  with a multipart upload, completed on ``commit``. Both are conditional
  (``If-None-Match: *``): a key that already exists is never overwritten, so no
  save attempt can replace a published generation's bytes, even by reusing its id.
- Every part and object carries a CRC32 checksum that S3 verifies on arrival.
- Part sizes grow by themselves (:func:`part_size_for`: doubling every 1,000 parts,
  capped at S3's 5 GiB), so a file of unknown size never needs S3's 10,001st part:
  with the smallest first part (5 MiB) 10,000 parts hold over 5 TB, with the
  default 16 MiB over 17 TB.
- ``abort`` waits for parts still in flight, then aborts the upload: parts that
  land after an abort would otherwise be stored (and billed) again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

from ckptvault.errors import SaveFailedError, UsageError
from ckptvault.storage.objects.uploads import PartUploader
from ckptvault.storage.s3.client import CHECKSUM, S3Client, S3Error, S3NotFound
from ckptvault.storage.s3.options import MAX_PART_SIZE

logger = logging.getLogger("ckptvault")

MAX_PARTS = 10_000  # S3: part numbers 1 to 10,000
PARTS_PER_DOUBLING = 1_000


def part_size_for(part_number: int, first_part_size: int) -> int:
    """The size of part ``part_number`` (1-based): ``first_part_size``, doubled every
    1,000 parts, at most 5 GiB. Only the last part of a file may be smaller."""
    doublings = (part_number - 1) // PARTS_PER_DOUBLING
    return min(first_part_size << min(doublings, 32), MAX_PART_SIZE)


def largest_object(first_part_size: int) -> int:
    """The most bytes one object can hold with 10,000 growing parts."""
    return sum(part_size_for(number, first_part_size) for number in range(1, MAX_PARTS + 1))


class S3WritableFile:
    """One new object of a staging area; see the module docstring."""

    def __init__(
        self,
        client: S3Client,
        uploader: PartUploader,
        key: str,
        first_part_size: int,
        on_commit: Callable[[str], None],
    ) -> None:
        self._client = client
        self._uploader = uploader
        self.key = key
        self._first_part_size = first_part_size
        self._on_commit = on_commit
        self._buffer = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._failure: BaseException | None = None
        self._state = "open"  # then "committed" or "aborted"

    @property
    def url(self) -> str:
        return self._client.url(self.key)

    @property
    def is_open(self) -> bool:
        """Neither committed nor aborted yet."""
        return self._state == "open"

    def write(self, data: bytes | bytearray | memoryview) -> int:
        self._check_writable()
        view = memoryview(data).cast("B")
        total = len(view)
        while len(view):
            part_size = part_size_for(len(self._parts) + 1, self._first_part_size)
            room = part_size - len(self._buffer)
            self._buffer += view[:room]
            view = view[room:]
            if len(self._buffer) >= part_size:
                try:
                    self._send_part()
                except S3Error as exc:
                    self.abort()
                    raise self._failed(exc) from exc
        return total

    def commit(self) -> None:
        """Upload what is buffered and wait until the object exists (complete)."""
        self._check_writable()
        try:
            if self._upload_id is None:
                self._client.put_new(self.key, self._buffer)  # small: one PUT
            else:
                if self._buffer:
                    self._send_part()
                self._complete([future.result() for future in self._parts])
        except BaseException as exc:
            self._state = "aborted"
            self._abandon()
            if isinstance(exc, S3Error):
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

    # -- helpers -------------------------------------------------------------------

    def _check_writable(self) -> None:
        if self._state != "open":
            raise UsageError(f"{self.url} was already {self._state}; it takes no more bytes")
        failure = self._failure
        if failure is not None:
            self.abort()
            if isinstance(failure, S3Error):
                raise self._failed(failure) from failure
            raise SaveFailedError(f"uploading {self.url}: {failure!r}") from failure

    def _send_part(self) -> None:
        number = len(self._parts) + 1
        if number > MAX_PARTS:
            raise SaveFailedError(
                f"{self.url} is larger than {largest_object(self._first_part_size)} bytes, the "
                f"most 10,000 parts hold from a first part of {self._first_part_size} bytes; "
                "raise s3_part_size"
            )
        if self._upload_id is None:
            response = self._client.call(
                "create_multipart_upload", self.key, ChecksumAlgorithm=CHECKSUM
            )
            self._upload_id = str(response["UploadId"])
        upload_id, body, self._buffer = self._upload_id, self._buffer, bytearray()

        def upload() -> dict[str, Any]:
            response = self._client.call(
                "upload_part",
                self.key,
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
                ChecksumAlgorithm=CHECKSUM,
            )
            part = {"PartNumber": number, "ETag": response["ETag"]}
            if response.get("ChecksumCRC32"):
                part["ChecksumCRC32"] = response["ChecksumCRC32"]
            return part

        future = self._uploader.submit(upload)
        future.add_done_callback(self._note_failure)
        self._parts.append(future)

    def _note_failure(self, future: Future[dict[str, Any]]) -> None:
        if self._failure is None and not future.cancelled() and future.exception() is not None:
            self._failure = future.exception()

    def _complete(self, parts: list[dict[str, Any]]) -> None:
        self._client.call(
            "complete_multipart_upload",
            self.key,
            UploadId=self._upload_id,
            MultipartUpload={"Parts": sorted(parts, key=lambda part: part["PartNumber"])},
            IfNoneMatch="*",  # never replace an existing object
        )

    def _abandon(self) -> None:
        """Forget the buffer; abort the multipart upload once no part is in flight."""
        self._buffer = bytearray()
        if self._upload_id is None:
            return
        wait(self._parts)
        try:
            self._client.call("abort_multipart_upload", self.key, UploadId=self._upload_id)
        except S3NotFound:
            pass  # completed or aborted already
        except S3Error as exc:
            logger.warning(
                "could not abort the upload to %s (%s); `ckptvault gc --stale-after` or "
                "Store.remove_stale_staging removes it later",
                self.url,
                exc,
            )

    def _failed(self, exc: S3Error) -> SaveFailedError:
        if exc.code == "PreconditionFailed":
            what = "the object already exists (a generation id was reused?); nothing is overwritten"
        else:
            what = str(exc)
        return SaveFailedError(
            f"uploading {self.url}: {what}. Nothing was published; earlier generations are intact"
        )
