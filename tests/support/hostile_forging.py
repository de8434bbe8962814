"""An attacker's forging tools, for generations of every format the reader accepts.

The attacker can write the store but holds no signing key and no key-encryption key.
After an edit they make every digest agree again, so that the attack meets the
parser and the checks behind the digests rather than the digest check:

- :func:`forge_manifest` edits the *logical* manifest (format 2's shape: ``files``
  with ``chunks``, ``dcp`` with every chunk; :mod:`forging`), recomputing each
  file's size and chunk digests from its bytes and deriving its whole-file digest.
  A format-2 generation gets one manifest back; a format-3 one a root and indexes
  whose digests all agree (the tensor table rebuilt from ``dcp``).
- :func:`forge_root` edits ``manifest.json`` exactly as stored (a format-3 root, or a
  format-2 manifest) and reseals its self-digest: for attacks on the root's own
  fields (its tensor table, its index records, names no index could cover).
- :func:`forge_index` edits one ``r<rank>-index.json`` and, by default, records its
  new size and digest in the root: for attacks on what an index says.

``raw`` (every tool) splices JSON text canonical JSON cannot say (NaN, deep nesting,
escapes, duplicate keys) in place of quoted placeholders, wherever they landed.
:func:`writer_format` makes the writer produce an older format, so that the
defences of that format, which an attacker can still plant, stay tested.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from blake3 import blake3

from ckptvault.format.canonical import dumps_canonical
from ckptvault.saving.generation_writer import GenerationWriter
from ckptvault.trust.digests import derived_file_digest
from support.common import writable
from support.forging import read_logical, write_logical

Change = Callable[[dict[str, Any]], None]
MANIFEST = "manifest.json"


@contextlib.contextmanager
def writer_format(version: int) -> Iterator[None]:
    """Generations saved inside are written in format ``version`` (2: one manifest
    holding every chunk digest and DCP's chunk metadata, no index)."""
    before = GenerationWriter.format_version
    GenerationWriter.format_version = version
    try:
        yield
    finally:
        GenerationWriter.format_version = before


def format_of(generation: Path) -> int:
    return json.loads((generation / MANIFEST).read_bytes()).get("format_version", 0)


def splice(data: bytes, raw: dict[str, str] | None) -> bytes:
    for placeholder, text in (raw or {}).items():
        data = data.replace(json.dumps(placeholder).encode(), text.encode())
    return data


def reseal(generation: Path, document: dict[str, Any], raw: dict[str, str] | None = None) -> bytes:
    """Write ``document`` as ``manifest.json`` with its self-digest computed over the
    bytes as stored (placeholders spliced); returns those bytes."""
    body = {key: value for key, value in document.items() if key != "manifest_blake3"}
    body["manifest_blake3"] = blake3(splice(dumps_canonical(body), raw)).hexdigest()
    data = splice(dumps_canonical(body), raw)
    writable(generation / MANIFEST).write_bytes(data)
    return data


def forge_manifest(
    generation: Path, change: Change | None = None, raw: dict[str, str] | None = None
) -> None:
    """Rewrite the generation's logical manifest (see the module docstring): each
    listed file's size and chunk digests recomputed from its bytes, ``change``
    applied, each whole-file digest derived again from the (possibly changed) size
    and chunks as formats 2-3 do, every index record and self-digest recomputed."""
    document = read_logical(generation)
    document.pop("manifest_blake3", None)
    chunk = document["chunk_size"]
    for name, record in document["files"].items():
        data = (generation / name).read_bytes()
        pieces = [data[i : i + chunk] for i in range(0, len(data), chunk)]
        record.update(size=len(data), chunks=[blake3(p).hexdigest() for p in pieces])
    if change is not None:
        change(document)
    for record in document["files"].values():
        size, chunks = record.get("size"), record.get("chunks")
        if type(size) is int and size >= 0 and isinstance(chunks, list):
            record["blake3"] = derived_file_digest(size, chunks)
    if document.get("format_version", 0) < 3:
        reseal(generation, document, raw)
        return
    write_logical(generation, document)
    if raw:
        forge_root(generation, lambda root: _splice_indexes(generation, root, raw), raw)


def _splice_indexes(generation: Path, root: dict[str, Any], raw: dict[str, str]) -> None:
    """Splice ``raw`` into every index holding a placeholder, and record it anew."""
    for name in root["indexes"]:
        data = (generation / name).read_bytes()
        spliced = splice(data, raw)
        if spliced != data:
            writable(generation / name).write_bytes(spliced)
            root["indexes"][name] = record_of(spliced)


def record_of(data: bytes) -> dict[str, Any]:
    """What a root records of an index with these bytes."""
    return {"size": len(data), "blake3": blake3(data).hexdigest()}


def forge_root(
    generation: Path, change: Change | None = None, raw: dict[str, str] | None = None
) -> bytes:
    """Apply ``change`` to ``manifest.json`` as stored and reseal it; returns its bytes."""
    document = json.loads((generation / MANIFEST).read_bytes())
    if change is not None:
        change(document)
    return reseal(generation, document, raw)


def forge_index(
    generation: Path,
    change: Change | None = None,
    raw: dict[str, str] | None = None,
    *,
    name: str = "r00000-index.json",
    record: bool = True,
    encode: Callable[[dict[str, Any]], bytes] = dumps_canonical,
) -> bytes:
    """Apply ``change`` to index ``name`` and write it with ``encode`` (canonical JSON
    by default, placeholders spliced); with ``record``, the root records its new size
    and digest (and is resealed). Returns the index's bytes."""
    document = json.loads((generation / name).read_bytes())
    if change is not None:
        change(document)
    data = splice(encode(document), raw)
    write_index(generation, name, data, record=record)
    return data


def write_index(generation: Path, name: str, data: bytes, *, record: bool = True) -> None:
    """Store ``data`` as index ``name``; with ``record``, the root vouches for it."""
    path = generation / name
    (writable(path) if path.exists() else path).write_bytes(data)
    if record:
        forge_root(generation, lambda root: root["indexes"].update({name: record_of(data)}))
