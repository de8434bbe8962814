"""An attacker's (or a test's) view of a generation's manifest as one document.

A format-3 generation keeps its manifest in two levels: ``manifest.json`` (the root:
files with sizes and digests, the indexes with theirs, the tensor table) and one
``r<rank>-index.json`` per rank (chunk digests and chunk metadata). Tests that edit
"the manifest" edit the *logical* document, the format-2 shape every reader builds in
memory: ``files`` with ``chunks``, ``dcp`` with every tensor's chunks.
:func:`read_logical` merges the levels; :func:`write_logical` splits an edited
document back into a root and indexes whose digests all agree (the tensor table is
rebuilt from ``dcp``), as anyone who can write the store can. Formats 1-2 pass
through unchanged, as one file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from blake3 import blake3

from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.index import (
    chunks_by_holder,
    encode_index,
    encode_tensor_chunks,
    files_by_holder,
)
from ckptvault.format.layout import INDEX_SUFFIX, file_holder, index_file_name
from ckptvault.format.records import FileRecord
from ckptvault.format.tensor_table import build_tensor_table
from support.common import writable

ROOT_ONLY = ("indexes", "tensors", "dcp_version", "manifest_blake3")


def read_logical(generation: Path) -> dict[str, Any]:
    """The generation's manifest with its indexes merged in (format 3), or as it is."""
    document = json.loads((generation / "manifest.json").read_bytes())
    if document.get("format_version", 0) < 3:
        return document
    tensors = {
        fqn: {"dtype": info["dtype"], "shape": info["shape"], "chunks": []}
        for fqn, info in document["tensors"].items()
    }
    files = {name: {**record, "chunks": []} for name, record in document["files"].items()}
    for name in document["indexes"]:
        index = json.loads((generation / name).read_bytes())
        for file, digests in index["files"].items():
            files[file]["chunks"] = digests
        for fqn, chunks in index["tensors"].items():
            for offsets, sizes, file, entry, start, length in chunks:
                tensors[fqn]["chunks"].append(
                    {
                        "offsets": offsets,
                        "sizes": sizes,
                        "file": file,
                        "name": entry,
                        "start": start,
                        "length": length,
                    }
                )
    logical = {k: v for k, v in document.items() if k not in ROOT_ONLY}
    logical.update(files=files, dcp={"version": document.get("dcp_version"), "tensors": tensors})
    return logical


def write_logical(generation: Path, document: dict[str, Any]) -> bytes:
    """Store an edited logical document (see the module docstring): format 3 as a root
    and indexes with every digest recomputed; older formats as one manifest with its
    self-digest. Returns the manifest bytes written."""
    document = {k: v for k, v in document.items() if k != "manifest_blake3"}
    if document.get("format_version", 0) >= 3:
        document = _split(generation, document)
    document["manifest_blake3"] = blake3(dumps_canonical(document)).hexdigest()
    data = dumps_canonical(document)
    writable(generation / "manifest.json").write_bytes(data)
    return data


def _split(generation: Path, document: dict[str, Any]) -> dict[str, Any]:
    files, dcp = document.pop("files"), document.pop("dcp")
    records = {
        name: FileRecord(r["size"], r["blake3"], tuple(r["chunks"])) for name, r in files.items()
    }
    by_holder = chunks_by_holder(dcp["tensors"])
    for stale in generation.glob(f"*{INDEX_SUFFIX}"):
        writable(stale).unlink()
    indexes = {}
    for holder, names in files_by_holder(list(records)).items():
        data = encode_index(
            document["run_id"],
            document["generation_id"],
            holder,
            {name: records[name] for name in names},
            encode_tensor_chunks(by_holder.get(holder, {})),
        )
        name = index_file_name(holder)
        (generation / name).write_bytes(data)
        indexes[name] = {"size": len(data), "blake3": blake3(data).hexdigest()}
    table = build_tensor_table(dcp["tensors"], lambda name: file_holder(name) or 0)
    document.update(
        files={name: {"size": r["size"], "blake3": r["blake3"]} for name, r in files.items()},
        indexes=indexes,
        tensors=table.to_json(),
        dcp_version=dcp.get("version"),
    )
    return document
