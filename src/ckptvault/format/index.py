"""Per-rank indexes (format version 3): the chunk metadata and chunk digests of the
files one rank wrote, kept out of the root manifest.

The root manifest lists every index by name with its size and BLAKE3 digest, so a
signature over the root covers every index (a two-level Merkle tree: root ->
index -> chunk digests -> bytes). Index ``r<rank>-index.json`` covers every file
whose name starts with ``r<rank>-``. It is canonical JSON::

    {"format_version": 3, "run_id": "...", "generation_id": "...", "holder": 7,
     "files": {"r00007-000.safetensors": ["<chunk digest>", ...]},
     "tensors": {"<fqn>": [[offsets, sizes, file, name, start, length], ...]}}

``files`` holds each covered file's chunk digests (the root's file digest is
derived from them: :func:`ckptvault.trust.digests.derived_file_digest`);
``tensors`` every chunk stored in those files: its box in the tensor, the file, the
entry name in the file's header, and its byte range. An index is read only after
its bytes matched the root's digest, and parsed under :data:`MAX_INDEX_BYTES`; the
indexes a root lists take at most :data:`MAX_INDEXES_TOTAL_BYTES` together.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptvault.errors import FormatError
from ckptvault.format.canonical import dumps_canonical, join_canonical_object, loads_canonical
from ckptvault.format.layout import file_holder, index_file_name
from ckptvault.format.records import FileRecord
from ckptvault.format.tensorfile import MAX_TENSOR_BYTES, MAX_TENSOR_RANK

INDEX_FORMAT_VERSION = 3
# One rank's chunks and digests: 64 MiB holds ~300,000 chunks of a rank's files.
MAX_INDEX_BYTES = 64 * 1024 * 1024
# All of a generation's indexes together, as the root records them. A reader that
# loads them all (verify, a one-process restore, a copy) keeps what they hold parsed,
# about 11 bytes a byte, so without this bound a planted root over many indexes of
# 64 MiB (empty chunks, chunk digests of a 1-byte chunk size) makes it keep ~700 MB
# each. 4 GiB holds the table's 2**24 cells (MAX_CELLS) at ~150 bytes a chunk record
# and the chunk digests of 100 TB in 4 MiB chunks.
MAX_INDEXES_TOTAL_BYTES = 4 << 30
MAX_INDEX_DEPTH = 8
MAX_ENTRY_NAME_CHARS = 4096
_HEX64_RE = re.compile(r"^[0-9a-f]{64}\Z")
_KEYS = {"format_version", "run_id", "generation_id", "holder", "files", "tensors"}


@dataclass(frozen=True)
class IndexRecord:
    """What the root promises about one index: its size and BLAKE3 digest."""

    size: int
    blake3: str

    def to_json(self) -> dict[str, object]:
        return {"size": self.size, "blake3": self.blake3}

    @classmethod
    def parse(cls, name: str, raw: Any, where: str) -> IndexRecord:
        size = raw.get("size") if isinstance(raw, dict) else None
        digest = raw.get("blake3") if isinstance(raw, dict) else None
        if (
            not isinstance(raw, dict)
            or set(raw) != {"size", "blake3"}
            or type(size) is not int
            or not 0 < size <= MAX_INDEX_BYTES
            or not isinstance(digest, str)
            or not _HEX64_RE.match(digest)
        ):
            raise FormatError(
                f"{where}: entry for index {name!r} needs a size (1..{MAX_INDEX_BYTES}) and a "
                "BLAKE3 digest"
            )
        return cls(size, digest)


@dataclass(frozen=True)
class IndexContents:
    """One parsed index: the chunk digests of its files, and its chunks (in the
    ``dcp`` section's dict form, ``offsets``/``sizes``/``file``/``name``/``start``/
    ``length``) by tensor."""

    holder: int
    file_chunks: dict[str, tuple[str, ...]]
    chunks: dict[str, list[dict[str, Any]]]


def files_by_holder(names: Mapping[str, object] | list[str]) -> dict[int, list[str]]:
    """The files each index covers; a name with no rank prefix is a writer's bug."""
    grouped: dict[int, list[str]] = defaultdict(list)
    for name in sorted(names):
        holder = file_holder(name)
        if holder is None:
            raise FormatError(f"file {name!r} has no r<rank>- prefix, so no index covers it")
        grouped[holder].append(name)
    return dict(grouped)


def encode_tensor_chunks(chunks: Mapping[str, list[dict[str, Any]]]) -> bytes:
    """The ``tensors`` member of an index, encoded (kept while a layout is unchanged):
    its canonical JSON, a tensor at a time, so that what is built to encode it is
    freed as it goes (10,000 tensors leave no 30,000 lists for the collector)."""
    pieces = (
        dumps_canonical(fqn)
        + b":"
        + dumps_canonical(
            [
                [c["offsets"], c["sizes"], c["file"], c["name"], c["start"], c["length"]]
                for c in chunks[fqn]
            ]
        )
        for fqn in sorted(chunks)
    )
    return b"{" + b",".join(pieces) + b"}"


def chunks_by_holder(tensors: Mapping[str, Any]) -> dict[int, dict[str, list[dict[str, Any]]]]:
    """Split a ``dcp`` section's chunks by the index covering each chunk's file."""
    split: dict[int, dict[str, list[dict[str, Any]]]] = defaultdict(dict)
    for fqn, info in tensors.items():
        for chunk in info["chunks"]:
            holder = file_holder(chunk["file"])
            if holder is None:
                raise FormatError(f"tensor {fqn!r} lives in {chunk['file']!r}, no rank's file")
            split[holder].setdefault(fqn, []).append(chunk)
    return dict(split)


def encode_index(
    run_id: str,
    generation_id: str,
    holder: int,
    files: Mapping[str, FileRecord],
    tensors_member: bytes,
) -> bytes:
    """The canonical bytes of index ``holder`` (``tensors_member``: from
    :func:`encode_tensor_chunks`)."""
    members = {
        "format_version": dumps_canonical(INDEX_FORMAT_VERSION),
        "run_id": dumps_canonical(run_id),
        "generation_id": dumps_canonical(generation_id),
        "holder": dumps_canonical(holder),
        "files": dumps_canonical(
            {name: list(record.chunks) for name, record in sorted(files.items())}
        ),
        "tensors": tensors_member,
    }
    data = join_canonical_object(members)
    if len(data) > MAX_INDEX_BYTES:
        raise FormatError(
            f"index {index_file_name(holder)} would be {len(data)} bytes; ckptvault reads "
            f"indexes of up to {MAX_INDEX_BYTES} bytes. Save fewer, larger tensors per rank, or "
            "raise chunk_size"
        )
    return data


def parse_index(
    data: bytes,
    holder: int,
    run_id: str,
    generation_id: str,
    files: Mapping[str, FileRecord],
    shapes: Mapping[str, tuple[int, ...]],
    where: str,
) -> IndexContents:
    """Parse index ``holder``'s bytes (already matched against the root's digest):
    it must name this run, generation and holder, list chunk digests for exactly
    ``files`` (the root's files it covers), and chunks of tensors the root lists
    (``shapes``), in those files, within bounds. Whether the chunks are the cells
    the root assigns to this index, and the digests derive the root's, is checked
    by the caller (:mod:`ckptvault.trust.indexes`)."""
    name = index_file_name(holder)
    at = f"{where}: {name}"
    raw = loads_canonical(data, at, max_depth=MAX_INDEX_DEPTH, max_bytes=MAX_INDEX_BYTES)
    if not isinstance(raw, dict) or set(raw) != _KEYS:
        raise FormatError(f"{at}: an index has exactly the keys {sorted(_KEYS)}")
    if raw["format_version"] != INDEX_FORMAT_VERSION or type(raw["format_version"]) is not int:
        raise FormatError(f"{at}: format_version must be {INDEX_FORMAT_VERSION}")
    identity = (raw["run_id"], raw["generation_id"], raw["holder"])
    if identity != (run_id, generation_id, holder) or type(raw["holder"]) is not int:
        raise FormatError(
            f"{at}: names run {str(raw['run_id'])[:100]!r}, generation "
            f"{str(raw['generation_id'])[:40]!r}, rank {str(raw['holder'])[:20]}; the root "
            f"manifest says {run_id!r}, {generation_id}, rank {holder}"
        )
    file_chunks = _parse_file_chunks(raw["files"], files, at)
    chunks = _parse_chunks(raw["tensors"], file_chunks, shapes, at)
    return IndexContents(holder, file_chunks, chunks)


def _parse_file_chunks(
    raw: Any, files: Mapping[str, FileRecord], at: str
) -> dict[str, tuple[str, ...]]:
    if not isinstance(raw, dict) or set(raw) != set(files):
        raise FormatError(f"{at}: does not list exactly the files of its rank the root lists")
    parsed = {}
    for name, digests in raw.items():
        if not isinstance(digests, list) or not all(
            isinstance(d, str) and _HEX64_RE.match(d) for d in digests
        ):
            raise FormatError(f"{at}: chunk digests of {name!r} are not 64-hex-digit strings")
        parsed[name] = tuple(digests)
    return parsed


def _parse_chunks(
    raw: Any,
    files: Mapping[str, tuple[str, ...]],
    shapes: Mapping[str, tuple[int, ...]],
    at: str,
) -> dict[str, list[dict[str, Any]]]:
    if not isinstance(raw, dict):
        raise FormatError(f"{at}: tensors must be an object")
    chunks: dict[str, list[dict[str, Any]]] = {}
    for fqn, entries in raw.items():
        shape = shapes.get(fqn)
        if shape is None:
            raise FormatError(f"{at}: holds tensor {fqn[:200]!r}, which the root does not list")
        if not isinstance(entries, list):
            raise FormatError(f"{at}: chunks of {fqn[:200]!r} must be a list")
        chunks[fqn] = [_parse_chunk(entry, shape, files, fqn, at) for entry in entries]
    return chunks


def _parse_chunk(
    entry: Any, shape: tuple[int, ...], files: Mapping[str, tuple[str, ...]], fqn: str, at: str
) -> dict[str, Any]:
    ok = isinstance(entry, list) and len(entry) == 6
    if ok:
        offsets, sizes, file, name, start, length = entry
        ok = (
            _is_box_side(offsets, len(shape))
            and _is_box_side(sizes, len(shape))
            and isinstance(file, str)
            and file in files
            and isinstance(name, str)
            and len(name) <= MAX_ENTRY_NAME_CHARS
            and _is_bounded(start)
            and _is_bounded(length)
            # Inside the shape, empty chunks too (they are no cell of the table, so
            # nothing else bounds them), as formats 1-2 require of every chunk.
            and all(o + s <= d for o, s, d in zip(offsets, sizes, shape, strict=True))
        )
    if not ok:
        raise FormatError(
            f"{at}: a chunk of {fqn[:200]!r} is malformed (it must be [offsets, sizes, file, "
            "name, start, length] with integer offsets and sizes of the tensor's rank that "
            "stay inside its shape, one of the index's files, and non-negative start and "
            "length)"
        )
    return {
        "offsets": offsets,
        "sizes": sizes,
        "file": file,
        "name": name,
        "start": start,
        "length": length,
    }


def _is_box_side(value: Any, rank: int) -> bool:
    return (
        isinstance(value, list)
        and len(value) == rank <= MAX_TENSOR_RANK
        and all(type(x) is int and 0 <= x <= MAX_TENSOR_BYTES for x in value)
    )


def _is_bounded(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_TENSOR_BYTES
