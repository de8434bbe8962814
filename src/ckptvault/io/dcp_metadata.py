"""DCP ``Metadata`` <-> JSON, so that no checkpoint metadata is ever pickled.

JSON form (the manifest's ``dcp`` key)::

    {"version": "<dcp metadata version>",
     "tensors": {"<fqn>": {"dtype": "float32", "shape": [..],
                           "chunks": [{"offsets": [..], "sizes": [..],
                                       "file": "r00000-000.safetensors",
                                       "name": "<key in that file>",
                                       "start": <absolute byte offset>,
                                       "length": <bytes>}]}}}
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckptvault.errors import FormatError
from ckptvault.format.tensorfile import DTYPES


@dataclass(frozen=True)
class StoredChunk:
    """Where one tensor chunk's bytes live; DCP's ``storage_data`` for an item."""

    file: str
    name: str
    start: int
    length: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str, where: str) -> torch.dtype:
    # Only names tensor files can hold: never getattr(torch, <a string from the store>).
    dtype = getattr(torch, name, None) if type(name) is str and name in DTYPES else None
    if not isinstance(dtype, torch.dtype):
        raise FormatError(f"{where}: unknown dtype {str(name)[:64]!r}")
    return dtype


def tensor_metadata(metadata: Metadata, fqn: str) -> TensorStorageMetadata:
    """The storage metadata of tensor ``fqn`` (ckptvault stores nothing else in DCP)."""
    info = metadata.state_dict_metadata[fqn]
    if not isinstance(info, TensorStorageMetadata):
        raise FormatError(f"entry {fqn!r} is not a tensor; ckptvault stores only tensors in DCP")
    return info


def metadata_to_json(
    metadata: Metadata, locations: dict[MetadataIndex, StoredChunk]
) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    for fqn, info in sorted(metadata.state_dict_metadata.items()):
        if not isinstance(info, TensorStorageMetadata):
            raise FormatError(
                f"entry {fqn!r} is not a tensor; ckptvault stores only tensors in DCP"
            )
        chunks = []
        for chunk in info.chunks:
            where = locations[MetadataIndex(fqn, chunk.offsets)]
            chunks.append(
                {
                    "offsets": list(chunk.offsets),
                    "sizes": list(chunk.sizes),
                    "file": where.file,
                    "name": where.name,
                    "start": where.start,
                    "length": where.length,
                }
            )
        tensors[fqn] = {
            "dtype": dtype_name(info.properties.dtype),
            "shape": list(info.size),
            "chunks": chunks,
        }
    return {"version": metadata.version, "tensors": tensors}


def metadata_from_json(
    raw: dict[str, Any], where: str
) -> tuple[Metadata, dict[MetadataIndex, StoredChunk]]:
    try:
        state_dict_metadata: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
        locations: dict[MetadataIndex, StoredChunk] = {}
        for fqn, info in raw["tensors"].items():
            dtype = dtype_from_name(info["dtype"], where)
            chunks = []
            for index, chunk in enumerate(info["chunks"]):
                offsets = torch.Size(int(x) for x in chunk["offsets"])
                chunks.append(
                    ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(chunk["sizes"]))
                )
                locations[MetadataIndex(fqn, offsets, index)] = StoredChunk(
                    file=chunk["file"],
                    name=chunk["name"],
                    start=int(chunk["start"]),
                    length=int(chunk["length"]),
                )
            state_dict_metadata[fqn] = TensorStorageMetadata(
                properties=TensorProperties(dtype=dtype),
                size=torch.Size(info["shape"]),
                chunks=chunks,
            )
    except (KeyError, TypeError, ValueError) as exc:
        raise FormatError(f"{where}: the manifest's dcp metadata is malformed ({exc!r})") from exc
    metadata = Metadata(state_dict_metadata=state_dict_metadata, version=raw.get("version"))
    metadata.storage_data = locations
    return metadata, locations
