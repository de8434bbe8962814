"""DCP write results between ranks as JSON: what each rank wrote, to rank 0.

A rank sends ``{"written": <results>, "index": <its index's size and digest, or
null>}`` (:func:`index_record`: format 3, every rank but 0 that wrote a file).
With a plan made afresh, the results are in full (below); with a reused plan
(:mod:`~ckptvault.distributed.plan_cache`), each file's size and digest only
(:func:`short_results_to_json`): where its chunks lie is what rank 0 validated
when it made the plan, and its index is checked against that.

In full, after writing its part of the global plan, a rank tells rank 0 where each
chunk lies and what each of its files holds, for the manifest::

    {"chunks": [[fqn, offsets, file, entry name, start, length], ...],
     "files": {file: {"size": .., "blake3": .., "chunks": [..]}},
     "keys": {file: [KEK id, wrapped data key (base64)]}}     # encrypted runs only

Rank 0 rebuilds DCP's ``WriteResult`` objects (their ``storage_data`` a
:class:`~ckptvault.io.writer.WrittenChunk`) only from a message in which every field
checks out: exactly the chunks rank 0 assigned to that rank, each once, under the
entry name and length its item implies, in a file named for that rank
(``r<rank>-<n>.safetensors``, ``.enc`` exactly when the run is encrypted), inside
the file's size; every file with a well-formed record (sizes bounded, digests 64 hex
digits) and, encrypted, a wrapped key.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ckptvault.distributed.wire import Field
from ckptvault.errors import FormatError
from ckptvault.format.index import MAX_ENTRY_NAME_CHARS, IndexRecord
from ckptvault.format.layout import index_file_name
from ckptvault.format.records import MAX_WRAPPED_KEY_CHARS, FileRecord
from ckptvault.format.tensorfile import DTYPES, MAX_TENSOR_BYTES, MAX_TENSOR_RANK
from ckptvault.io.dcp_metadata import StoredChunk, dtype_name
from ckptvault.io.writer import WrittenChunk, chunk_name

MAX_KEK_ID_CHARS = 1024
_HEX64_RE = re.compile(r"^[0-9a-f]{64}\Z")


def results_to_json(results: list[WriteResult]) -> dict[str, Any]:
    """This rank's write results as a message."""
    chunks, files, keys = [], {}, {}
    for result in results:
        written: WrittenChunk = result.storage_data
        where = written.location
        chunks.append(
            [
                result.index.fqn,
                list(result.index.offset or ()),
                where.file,
                where.name,
                where.start,
                where.length,
            ]
        )
        if written.file_record is not None:
            files[where.file] = written.file_record.to_json()
        if written.wrapped_key is not None:
            kek_id, wrapped = written.wrapped_key
            keys[where.file] = [kek_id, base64.b64encode(wrapped).decode("ascii")]
    return {"chunks": chunks, "files": files, "keys": keys}


def results_from_json(
    raw: Any, rank: int, assigned: SavePlan, world: int, encrypted: bool
) -> list[WriteResult]:
    """Rank ``rank``'s write results for the items of ``assigned`` (its part of the
    global plan), every field checked; PeerMessageError otherwise."""
    field = Field(rank, "write results")
    message = field.mapping(raw, ("chunks", "files", "keys"), "the results")
    records = _records(message["files"], field, rank, world, encrypted)
    keys = _keys(message["keys"], field, records if encrypted else {})
    expected = {item.index: item for item in assigned.items}
    chunks = field.sequence(message["chunks"], "chunks", len(expected))
    results: list[WriteResult] = []
    used: set[str] = set()
    for entry in chunks:
        item, location = _chunk(entry, field, expected, records)
        del expected[item.index]  # each assigned item once
        first = location.file not in used
        used.add(location.file)
        stored = WrittenChunk(
            location,
            records[location.file] if first else None,
            keys.get(location.file) if first else None,
        )
        results.append(WriteResult(item.index, location.length, stored))
    if used != set(records):
        raise field.refuse("a file record for a file that holds none of the rank's chunks")
    return results


def _records(
    raw: Any, field: Field, rank: int, world: int, encrypted: bool
) -> dict[str, FileRecord]:
    if not isinstance(raw, dict):
        raise field.refuse("files must be an object")
    records = {}
    for name, record in raw.items():
        field.tensor_file(name, rank, world, encrypted)
        try:
            records[name] = FileRecord.parse(name, record, f"rank {rank}'s results")
        except FormatError as exc:
            raise field.refuse(str(exc)) from exc
        # One digest a chunk of the file: never more than bytes in it.
        if len(records[name].chunks) > max(1, records[name].size):
            raise field.refuse(f"file {name!r}: more chunk digests than bytes")
    return records


def _keys(raw: Any, field: Field, records: dict[str, FileRecord]) -> dict[str, tuple[str, bytes]]:
    """The wrapped data key of each encrypted file (none for a plain run)."""
    keys = field.mapping(raw, tuple(records), "keys")
    found = {}
    for name, entry in keys.items():
        kek_id, encoded = field.sequence(entry, "a wrapped key", 2)
        kek_id = field.text(kek_id, "a KEK id", MAX_KEK_ID_CHARS)
        encoded = field.text(encoded, "a wrapped key", MAX_WRAPPED_KEY_CHARS)
        try:
            found[name] = (kek_id, base64.b64decode(encoded, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise field.refuse(f"the wrapped key of {name!r} is not base64") from exc
    return found


def _chunk(
    raw: Any,
    field: Field,
    expected: dict[MetadataIndex, WriteItem],
    records: dict[str, FileRecord],
) -> tuple[WriteItem, StoredChunk]:
    fqn, offsets, file, name, start, length = field.sequence(raw, "a chunk", 6)
    fqn = field.text(fqn, "a tensor name", MAX_ENTRY_NAME_CHARS)
    offsets = field.sequence(offsets, "offsets")
    if len(offsets) > MAX_TENSOR_RANK:
        raise field.refuse("offsets longer than a tensor's rank")
    box = field.counts(offsets, "offsets", len(offsets), MAX_TENSOR_BYTES)
    item = expected.get(MetadataIndex(fqn, torch.Size(box)))
    if item is None or item.tensor_data is None:
        raise field.refuse(f"a chunk of {fqn[:100]!r} that rank 0 did not assign, or twice")
    if not isinstance(file, str) or file not in records:
        raise field.refuse(f"a chunk of {fqn[:100]!r} in a file without a record")
    data = item.tensor_data
    nbytes = math.prod(data.chunk.sizes) * DTYPES[dtype_name(data.properties.dtype)][1]
    if name != chunk_name(item) or length != nbytes:
        raise field.refuse(f"a chunk of {fqn[:100]!r} under another name or length")
    start = field.count(start, "a start", 0, records[file].size - nbytes)
    return item, StoredChunk(file=file, name=name, start=start, length=nbytes)


# -- a reused plan: what each file holds is known; its size and digest are new -------


def short_results_to_json(results: list[WriteResult]) -> dict[str, Any]:
    """This rank's write results when rank 0 reused the plan: each file's size and
    digest (and wrapped key), no chunk: their places are what rank 0 validated when
    it made the plan, and the rank's index lists them (checked by rank 0)::

        {"files": {file: [size, blake3]}, "keys": {file: [KEK id, wrapped key]}}
    """
    full = results_to_json(results)
    files = {name: [record["size"], record["blake3"]] for name, record in full["files"].items()}
    return {"files": files, "keys": full["keys"]}


def short_results_from_json(
    raw: Any, rank: int, expected: Mapping[str, int], encrypted: bool
) -> tuple[dict[str, FileRecord], dict[str, tuple[str, bytes]]]:
    """Rank ``rank``'s file records (no chunk digests: its index holds them) and
    wrapped keys, from a message naming exactly the files ``expected`` (name ->
    size) with those sizes; PeerMessageError otherwise."""
    field = Field(rank, "write results")
    message = field.mapping(raw, ("files", "keys"), "the results")
    files = field.mapping(message["files"], tuple(expected), "files")
    records = {}
    for name, entry in files.items():
        size, digest = field.sequence(entry, "a file record", 2)
        if size != expected[name] or type(size) is not int:
            raise field.refuse(f"file {name!r} of another size than the plan made it")
        if not isinstance(digest, str) or not _HEX64_RE.match(digest):
            raise field.refuse(f"file {name!r}: a digest that is not 64 hex digits")
        records[name] = FileRecord(size=size, blake3=digest, chunks=())
    return records, _keys(message["keys"], field, records if encrypted else {})


def index_record(raw: Any, rank: int, writes_files: bool) -> IndexRecord | None:
    """The size and digest rank ``rank`` announces of the index it wrote: one when it
    wrote a file (rank 0 writes its own later: None), none otherwise."""
    field = Field(rank, "write results")
    if raw is None and not (writes_files and rank != 0):
        return None
    if rank == 0 or not writes_files:
        raise field.refuse("an index record from a rank that writes no index now")
    try:
        return IndexRecord.parse(index_file_name(rank), raw, f"rank {rank}'s write results")
    except FormatError as exc:
        raise field.refuse(str(exc)) from exc
