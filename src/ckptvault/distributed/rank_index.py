"""Each rank's own index (format 3), written by that rank and checked by rank 0.

A format-3 generation has one index per rank that wrote a file
(:mod:`ckptvault.format.index`): the chunk digests of its files and where each of its
chunks lies. Rank 0 used to build and write all of them, from every rank's chunk
metadata: at 1,024 ranks of a 723-tensor model, most of the ~18 s of its part of
each save. Every rank already knows its own, so it writes it into the staging area
beside its tensor files, and tells rank 0 its size and BLAKE3 digest. Rank 0 binds
that record into the root it signs (a restore checks every index against it, as
before), but only after reading the index back and finding it to be exactly the
index it expects (:func:`check_rank_index`):

- its bytes match the size and digest the rank announced;
- it names this run, this generation and that rank;
- its ``tensors`` member is byte for byte the chunk list rank 0 validated when it
  made the plan (kept as a digest: :class:`IndexExpectation`);
- it lists chunk digests for exactly the files the rank reported, as many as each
  file's size needs, deriving the file digest the root records for it.

So the root rank 0 publishes covers only an index that a restore accepts, and a
rank whose index differs from what it announced, or from what it must hold, makes
the save fail on every rank with nothing published. Reading back costs rank 0 one
read and one hash of each index: no chunk is parsed. Chunks are listed in one
order on both sides (each tensor's by offsets), so both encode the same bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from blake3 import blake3
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ckptvault.errors import FormatError, IntegrityError
from ckptvault.format.canonical import dumps_canonical, join_canonical_object, loads_canonical
from ckptvault.format.index import (
    INDEX_FORMAT_VERSION,
    MAX_INDEX_BYTES,
    MAX_INDEX_DEPTH,
    IndexRecord,
    encode_index,
    encode_tensor_chunks,
)
from ckptvault.format.layout import index_file_name
from ckptvault.format.records import FileRecord
from ckptvault.format.tensor_table import TensorTable
from ckptvault.io.writer import WrittenChunk
from ckptvault.storage.base import StagingArea, write_new_file
from ckptvault.trust.digests import derived_file_digest

PARALLEL_READS = 8
_FILES_HEAD = b'{"files":'
_HEX_RE = re.compile(r"[0-9a-f]*\Z")

Chunks = dict[str, list[dict[str, Any]]]  # fqn -> chunks, as an index lists them


@dataclass
class SaveIndexes:
    """One format-3 save's indexes, as the save driver learns them: this rank's own
    files (with chunk digests) and chunks, for its index; on rank 0 also the index
    each other rank announced, what each must hold, and the root's tensor table."""

    run_id: str
    generation_id: str
    own_records: dict[str, FileRecord] = field(default_factory=dict)
    own_chunks: Chunks = field(default_factory=dict)
    announced: dict[int, IndexRecord] = field(default_factory=dict)
    expectations: dict[int, IndexExpectation] = field(default_factory=dict)
    table: TensorTable | None = None


@dataclass(frozen=True)
class IndexExpectation:
    """What rank 0 knows of rank ``holder``'s index before reading it: the files it
    covers (name -> size) and the BLAKE3 and length of its encoded ``tensors``
    member, which the plan and the writer's layout fix."""

    holder: int
    files: dict[str, int]
    tensors_blake3: str
    tensors_size: int


def index_chunks(items: Iterable[WriteItem], results: Iterable[WriteResult]) -> Chunks:
    """The chunks a rank wrote, as its index lists them: each item's box and where
    its bytes lie, by tensor, each tensor's in order of offsets."""
    boxes: dict[MetadataIndex, WriteItem] = {item.index: item for item in items}
    chunks: Chunks = {}
    for result in results:
        written: WrittenChunk = result.storage_data
        item = boxes[result.index]
        assert item.tensor_data is not None  # tensors only (the planner refuses others)
        box = item.tensor_data.chunk
        where = written.location
        chunks.setdefault(result.index.fqn, []).append(
            {
                "offsets": list(box.offsets),
                "sizes": list(box.sizes),
                "file": where.file,
                "name": where.name,
                "start": where.start,
                "length": where.length,
            }
        )
    for entries in chunks.values():
        entries.sort(key=lambda chunk: chunk["offsets"])
    return chunks


def expectation(holder: int, files: Mapping[str, int], chunks: Chunks) -> IndexExpectation:
    """What rank ``holder``'s index must hold besides digests."""
    member = encode_tensor_chunks(chunks)
    return IndexExpectation(holder, dict(files), blake3(member).hexdigest(), len(member))


def write_rank_index(
    area: StagingArea,
    run_id: str,
    generation_id: str,
    holder: int,
    records: Mapping[str, FileRecord],
    chunks: Chunks,
) -> tuple[str, IndexRecord]:
    """Write rank ``holder``'s index into ``area`` (durable on return); its name and
    the record the root keeps of it."""
    data = encode_index(run_id, generation_id, holder, records, encode_tensor_chunks(chunks))
    name = index_file_name(holder)
    write_new_file(area, name, data)
    return name, IndexRecord(len(data), blake3(data).hexdigest())


def check_rank_index(
    data: bytes,
    announced: IndexRecord,
    expected: IndexExpectation,
    files: Mapping[str, FileRecord],
    run_id: str,
    generation_id: str,
    chunk_size: int,
) -> None:
    """Refuse rank ``expected.holder``'s index bytes unless they are what it announced
    and exactly what it must hold (see the module docstring). ``files``: the size
    and file digest the rank reported for each of its files, which the root is to
    record. IntegrityError or FormatError naming the rank and what differs."""
    holder = expected.holder
    where = f"rank {holder}'s index {index_file_name(holder)}"
    if len(data) != announced.size or blake3(data).hexdigest() != announced.blake3:
        raise IntegrityError(
            f"{where} is not what the rank announced ({len(data)} bytes read, "
            f"{announced.size} announced, or another digest): a fault or a dishonest rank"
        )
    tail = _tail(run_id, generation_id, holder)
    size = expected.tensors_size
    if (
        not data.startswith(_FILES_HEAD)
        or not data.endswith(b"}")
        or len(data) < len(_FILES_HEAD) + len(tail) + size + 1
        or data[-1 - size - len(tail) : -1 - size] != tail
        or blake3(data[-1 - size : -1]).hexdigest() != expected.tensors_blake3
    ):
        raise FormatError(
            f"{where} does not hold this run's, generation's and rank's identity and exactly "
            "the chunks rank 0 planned for it"
        )
    _check_file_chunks(data[len(_FILES_HEAD) : -1 - size - len(tail)], files, chunk_size, where)


def verify_rank_indexes(
    area: StagingArea,
    announced: Mapping[int, IndexRecord],
    expected: Mapping[int, IndexExpectation],
    records: Mapping[str, FileRecord],
    run_id: str,
    generation_id: str,
    chunk_size: int,
) -> None:
    """Read back the index of every rank in ``expected`` from ``area`` and check it
    (:func:`check_rank_index`), several at a time; the first refusal raises."""

    def check(holder: int) -> None:
        plan, record = expected[holder], announced[holder]
        # Never more than it announced (a larger file is refused: EFBIG).
        data = area.read_staged(index_file_name(holder), min(record.size, MAX_INDEX_BYTES))
        files = {name: records[name] for name in plan.files}
        check_rank_index(data, record, plan, files, run_id, generation_id, chunk_size)

    holders = sorted(expected)
    if len(holders) <= 1:
        for holder in holders:
            check(holder)
        return
    with ThreadPoolExecutor(min(PARALLEL_READS, len(holders)), "ckptvault-index-check") as pool:
        for _ in pool.map(check, holders):
            pass


def root_indexes(
    area: StagingArea,
    indexes: SaveIndexes,
    own: Mapping[str, FileRecord],
    records: Mapping[str, FileRecord],
    chunk_size: int,
) -> dict[str, IndexRecord]:
    """Rank 0's part of a format-3 publish: every index the root lists. Rank 0's own,
    written here over ``own`` (its tensor files and, encrypted, its state file, each
    with its chunk digests), and every other rank's as it announced it, once read
    back and found to be exactly what that rank must hold (:func:`verify_rank_indexes`;
    ``records``: every file's record as its rank reported it)."""
    listed: dict[str, IndexRecord] = {}
    if own:
        name, record = write_rank_index(
            area, indexes.run_id, indexes.generation_id, 0, own, indexes.own_chunks
        )
        listed[name] = record
    others = {rank: plan for rank, plan in indexes.expectations.items() if rank != 0}
    verify_rank_indexes(
        area,
        indexes.announced,
        others,
        records,
        indexes.run_id,
        indexes.generation_id,
        chunk_size,
    )
    listed.update({index_file_name(rank): r for rank, r in indexes.announced.items()})
    return listed


def _tail(run_id: str, generation_id: str, holder: int) -> bytes:
    """What follows an index's ``files`` member up to its ``tensors`` member's value:
    the members in between, as :func:`~ckptvault.format.index.encode_index` joins them."""
    members = {
        "format_version": dumps_canonical(INDEX_FORMAT_VERSION),
        "generation_id": dumps_canonical(generation_id),
        "holder": dumps_canonical(holder),
        "run_id": dumps_canonical(run_id),
        "tensors": b"",
    }
    joined = join_canonical_object({"files": b"", **members})
    return joined[len(_FILES_HEAD) : -1]


def _check_file_chunks(
    encoded: bytes, files: Mapping[str, FileRecord], chunk_size: int, where: str
) -> None:
    """The ``files`` member: canonical, exactly ``files``, each with as many 64-hex
    chunk digests as its size needs, which derive its digest."""
    raw = loads_canonical(encoded, where, max_depth=MAX_INDEX_DEPTH, max_bytes=MAX_INDEX_BYTES)
    if not isinstance(raw, dict) or set(raw) != set(files):
        raise FormatError(f"{where} does not list exactly the files the rank reported")
    for name, digests in raw.items():
        record = files[name]
        expected = -(-record.size // chunk_size)
        if (
            not isinstance(digests, list)
            or len(digests) != expected
            or not all(type(d) is str and len(d) == 64 for d in digests)
        ):
            raise FormatError(f"{where}: {name} needs {expected} chunk digests of 64 hex digits")
        if (
            not _HEX_RE.match("".join(digests))
            or derived_file_digest(record.size, digests) != record.blake3
        ):
            raise IntegrityError(
                f"{where}: the chunk digests of {name} do not derive the file digest the rank "
                "reported for it"
            )
