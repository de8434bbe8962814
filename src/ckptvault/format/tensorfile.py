"""Safetensors-compatible tensor files, written and parsed without torch.

Layout (the safetensors format): an 8-byte little-endian header length ``N``, ``N``
bytes of JSON header (padded with spaces to a multiple of 8), then the tensors' raw
bytes packed back to back. The header maps each tensor name to its dtype, shape and
``data_offsets`` (relative to the start of the data region); a ``__metadata__`` entry
holds string pairs. Stock ``safetensors.safe_open`` reads these files.

ckptvault streams the data region itself (see ``ckptvault.io.writer``); this module
only builds and validates headers, so ``ckptvault verify`` can check them without
importing torch.

A header is read from the store, so its parser is bounded (DESIGN rule 5): the
restore checks cap its size at what the entries the manifest places in the file
need (:func:`header_size_limit`) and verify its bytes against the manifest's chunk
digests before it is parsed; the JSON is parsed by
:func:`~ckptvault.format.bounded_json.loads_bounded` (depth, no NaN/Infinity), and
every shape and offset must be a plain non-negative integer.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptvault.errors import FormatError
from ckptvault.format.bounded_json import MAX_HEADER_DEPTH, loads_bounded

HEADER_LENGTH_BYTES = 8
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
# What a header may take beyond its entries, and per entry beyond the entry's name
# (dtype, shape, offsets); names may grow 6-fold when JSON escapes them.
HEADER_BASE_ALLOWANCE = 64 * 1024
HEADER_ENTRY_ALLOWANCE = 1024
MAX_TENSOR_RANK = 64
MAX_TENSOR_BYTES = 1 << 62  # keeps every element count and stride inside int64
_ALIGNMENT = 8

# torch dtype name -> (safetensors dtype, element size in bytes)
DTYPES: dict[str, tuple[str, int]] = {
    "bool": ("BOOL", 1),
    "uint8": ("U8", 1),
    "int8": ("I8", 1),
    "int16": ("I16", 2),
    "uint16": ("U16", 2),
    "int32": ("I32", 4),
    "uint32": ("U32", 4),
    "int64": ("I64", 8),
    "uint64": ("U64", 8),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float32": ("F32", 4),
    "float64": ("F64", 8),
    "complex64": ("C64", 8),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "float8_e4m3fnuz": ("F8_E4M3FNUZ", 1),
    "float8_e5m2fnuz": ("F8_E5M2FNUZ", 1),
}
_FROM_SAFETENSORS = {code: name for name, (code, _size) in DTYPES.items()}


def element_size(dtype: str) -> int:
    try:
        return DTYPES[dtype][1]
    except KeyError:
        raise FormatError(f"dtype {dtype} has no safetensors encoding") from None


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor in a tensor file; ``start``/``end`` are absolute file offsets."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class TensorFileHeader:
    header_bytes: bytes  # the 8-byte length prefix and the padded JSON header
    entries: dict[str, TensorEntry]
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        return len(self.header_bytes)


def build_header(
    tensors: Iterable[tuple[str, str, tuple[int, ...]]], metadata: Mapping[str, str]
) -> TensorFileHeader:
    """Lay out ``(name, dtype, shape)`` tensors back to back, in the order given.

    The header's JSON is written entry by entry as text (what ``json.dumps`` of the
    whole layout writes, byte for byte): a layout of 10,000 tensors then leaves no
    30,000 dicts and lists behind for Python's collector to walk."""
    pieces = [f'"__metadata__":{_dumps(dict(metadata))}'] if metadata else []
    spans: list[tuple[str, str, tuple[int, ...], int, int]] = []
    seen: set[str] = set()
    offset = 0
    for name, dtype, shape in tensors:
        if name in seen or name == "__metadata__":
            raise FormatError(f"tensor name {name!r} appears twice in one tensor file")
        seen.add(name)
        code, size = DTYPES.get(dtype, (None, 0))
        if code is None:
            raise FormatError(f"dtype {dtype} of tensor {name!r} has no safetensors encoding")
        nbytes = math.prod(shape) * size
        dims = ",".join(map(str, shape))
        pieces.append(
            f'{_dumps(name)}:{{"dtype":"{code}","shape":[{dims}],'
            f'"data_offsets":[{offset},{offset + nbytes}]}}'
        )
        spans.append((name, dtype, tuple(shape), offset, offset + nbytes))
        offset += nbytes
    text = ("{" + ",".join(pieces) + "}").encode("utf-8")
    text += b" " * (-len(text) % _ALIGNMENT)
    prefix = struct.pack("<Q", len(text)) + text
    base = len(prefix)
    entries = {
        name: TensorEntry(name, dtype, shape, base + start, base + end)
        for name, dtype, shape, start, end in spans
    }
    return TensorFileHeader(prefix, entries, dict(metadata))


_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode  # one, reused


def header_size_limit(entry_names: Iterable[str]) -> int:
    """The largest header a tensor file holding ``entry_names`` may have: a small
    multiple of what those entries need, so that a planted header cannot make a
    reader spend more than the manifest's own size accounts for."""
    return (
        HEADER_LENGTH_BYTES
        + HEADER_BASE_ALLOWANCE
        + sum(
            HEADER_ENTRY_ALLOWANCE + 6 * len(name.encode("utf-8", "surrogatepass"))
            for name in entry_names
        )
    )


def header_length(prefix: bytes, file_size: int, where: str, limit: int = MAX_HEADER_BYTES) -> int:
    """Total header size (length prefix included) from a file's first 8 bytes;
    more than ``limit`` bytes in all is refused."""
    if len(prefix) < HEADER_LENGTH_BYTES:
        raise FormatError(f"{where}: too short to be a tensor file ({file_size} bytes)")
    (length,) = struct.unpack("<Q", prefix[:HEADER_LENGTH_BYTES])
    if HEADER_LENGTH_BYTES + length > file_size:
        raise FormatError(
            f"{where}: header length {length} does not fit the file ({file_size} bytes)"
        )
    if HEADER_LENGTH_BYTES + length > min(limit, MAX_HEADER_BYTES):
        raise FormatError(
            f"{where}: header of {length} bytes is larger than the "
            f"{min(limit, MAX_HEADER_BYTES) - HEADER_LENGTH_BYTES} its tensors can need"
        )
    return HEADER_LENGTH_BYTES + length


def checked_shape(value: Any, dtype: str, where: str) -> tuple[int, ...]:
    """A shape from untrusted JSON: a list of plain non-negative ints (never bool or
    float) whose bytes, counting empty dimensions as 1, stay below MAX_TENSOR_BYTES."""
    if not isinstance(value, list) or len(value) > MAX_TENSOR_RANK:
        raise FormatError(f"{where}: shape must be a list of at most {MAX_TENSOR_RANK} integers")
    bound = MAX_TENSOR_BYTES // element_size(dtype)
    span = 1
    for dim in value:
        if type(dim) is not int or dim < 0:  # is_count, inline: once per dimension
            raise FormatError(
                f"{where}: shape {str(value)[:200]} holds {str(dim)[:40]!r}, not a "
                "non-negative integer"
            )
        span *= max(dim, 1)
        if span > bound:
            raise FormatError(f"{where}: shape {str(value)[:200]} is implausibly large")
    return tuple(value)


def is_count(value: Any) -> bool:
    """A plain non-negative int (JSON ``true`` and ``1.0`` are not)."""
    return type(value) is int and value >= 0


def parse_header(
    header: bytes, file_size: int, where: str, limit: int = MAX_HEADER_BYTES
) -> TensorFileHeader:
    """Validate a tensor file's header the way safetensors does, and more strictly.

    ``header`` must be the file's first ``header_length(...)`` bytes. Tensors must
    tile the data region exactly (no gaps, no overlap, nothing after the last one).
    """
    total = header_length(header, file_size, where, limit)
    if len(header) != total:
        raise FormatError(f"{where}: header truncated")
    raw = loads_bounded(
        header[HEADER_LENGTH_BYTES:total], f"{where}: header", max_depth=MAX_HEADER_DEPTH
    )
    if not isinstance(raw, dict):
        raise FormatError(f"{where}: header is not a JSON object")
    metadata = raw.pop("__metadata__", {}) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise FormatError(f"{where}: __metadata__ must map strings to strings")
    entries: dict[str, TensorEntry] = {}
    for name, info in raw.items():
        code = info.get("dtype") if isinstance(info, dict) else None
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (
            not isinstance(code, str)
            or code not in _FROM_SAFETENSORS
            or not isinstance(offsets, list)
            or len(offsets) != 2
            or not (is_count(offsets[0]) and is_count(offsets[1]))
        ):
            raise FormatError(f"{where}: tensor {name!r} has a malformed entry")
        dtype = _FROM_SAFETENSORS[code]
        shape = checked_shape(info.get("shape"), dtype, f"{where}: tensor {name!r}")
        start, end = offsets
        if math.prod(shape) * element_size(dtype) != end - start:
            raise FormatError(f"{where}: tensor {name!r} size does not match its shape")
        entries[name] = TensorEntry(name, dtype, shape, total + start, total + end)
    position = total
    for entry in sorted(entries.values(), key=lambda e: (e.start, e.end)):
        if entry.start != position:
            raise FormatError(f"{where}: tensor data is not packed (gap or overlap at {position})")
        position = entry.end
    if position != file_size:
        raise FormatError(
            f"{where}: tensor data ends at byte {position} but the file has {file_size} bytes"
        )
    return TensorFileHeader(header, entries, metadata)
