"""The manifest: what a generation holds and the digests that prove it.

``manifest.json`` sits at the root of every generation in canonical JSON (see
:mod:`ckptvault.format.canonical`), so its exact bytes can be signed. It holds no
absolute paths: file names are plain names relative to the generation, so a copied
or moved store stays valid.

Format version 3 (written now) splits the manifest in two levels: this root, which
is all a reader parses before it has verified anything and whose size grows with
files and tensors but not with ranks x tensors, and one index per rank
(:mod:`ckptvault.format.index`) with that rank's chunk metadata and chunk digests,
listed here with its digest, so a signature over the root covers them all. A root
has ``files`` of name -> ``{size, blake3}`` only, ``indexes`` (name -> ``{size,
blake3}``), ``tensors`` (:mod:`ckptvault.format.tensor_table`: each tensor's dtype,
shape, chunk grid and which index holds each chunk) and ``dcp_version`` in place of
``dcp``; the other keys are as below, and no other key is accepted. In memory a
:class:`Manifest` of format 3 is the whole: once its indexes are loaded
(:mod:`ckptvault.trust.indexes`) ``files`` has chunk digests and ``dcp`` chunks,
for the indexes loaded.

Top-level keys of format versions 1 and 2 (2 derives each file's whole-file digest
from its chunk digests, see :mod:`ckptvault.trust.digests`):

- ``format_version``, ``run_id``, ``step``, ``generation_id``, ``created_at``, ``parent``
- ``chunk_size`` and ``files``: name -> ``{size, blake3, chunks}`` for every file
- ``dcp``: torch.distributed.checkpoint metadata as JSON (tensor -> dtype, shape,
  chunks and where each chunk's bytes live)
- ``state``: the JSON leaves and the structure of the saved state (tensors appear as
  ``{"$tensor": key}`` references into ``dcp``)
- ``contract``: the run contract (user fields, code revision, versions)
- ``writer``: who wrote it (ckptvault version, world size)
- ``encryption`` (encrypted generations only): see :class:`EncryptionSection`;
  it also carries the manifest's MAC over :func:`authenticated_bytes`
- ``metrics`` (optional): name -> finite number, as given to ``save(..., metrics=)``;
  retention's ``keep_best`` reads it. Covered by the self-digest and the signature
  like every other key; manifests without it parse as before.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from blake3 import blake3

from ckptvault.errors import FormatError
from ckptvault.format.bounded_json import MAX_DOCUMENT_DEPTH, scan_json
from ckptvault.format.canonical import (
    dumps_canonical,
    join_canonical_object,
    loads_canonical,
    loads_canonical_members,
)
from ckptvault.format.index import MAX_INDEXES_TOTAL_BYTES, IndexRecord
from ckptvault.format.layout import (
    MANIFEST_NAME,
    MAX_STEP,
    SIGNATURE_NAME,
    file_holder,
    index_file_name,
    is_generation_id,
    is_index_file_name,
)
from ckptvault.format.records import (
    MANIFEST_MAC,
    EncryptionSection,
    FileRecord,
    check_dcp_section,
)
from ckptvault.format.tensor_table import TensorTable, parse_tensor_table

# 2: whole-file digests are derived from the chunk digests (ckptvault.trust.digests).
# 3: a root manifest and per-rank indexes (ckptvault.format.index).
FORMAT_VERSION = 3
INDEXED_SINCE_FORMAT = 3
MAX_CHUNK_SIZE = 1 << 30
SELF_DIGEST_KEY = "manifest_blake3"
READABLE_FORMAT_VERSIONS = frozenset({1, 2, 3})
# A manifest is read (and, unsigned, parsed) before anything is verified, so it is
# capped. Formats 1-2 held every chunk digest (a 1 TB checkpoint's take about 17 MB),
# so a manifest of those may be up to 64 MiB: that is what is read before the format
# is known. A format-3 root holds no chunk digest and no per-rank chunk: about 130
# bytes a tensor and 120 a file, so 32 MiB is over 200,000 tensors.
MAX_MANIFEST_BYTES = 64 * 1024 * 1024
MAX_ROOT_BYTES = 32 * 1024 * 1024
_ROOT_KEYS = frozenset(
    {
        "format_version", "run_id", "step", "generation_id", "created_at", "parent",
        "chunk_size", "files", "indexes", "tensors", "dcp_version", "state", "contract",
        "writer", "encryption", "metrics", SELF_DIGEST_KEY,
    }
)  # fmt: skip
MAX_MANIFEST_DEPTH = MAX_DOCUMENT_DEPTH

# A file name inside a generation: one plain path component, never hidden, never a
# traversal, never one of the reserved names.
_FILE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}\Z")
RESERVED_NAMES = frozenset({MANIFEST_NAME, SIGNATURE_NAME})
MAX_METRICS = 256
_METRIC_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.:/-]{0,127}\Z")
_MAX_METRIC_INT = 2**63


class ManifestDigestError(FormatError):
    """The manifest's bytes do not match its own digest: corrupted after writing."""


class UnsafeNameError(FormatError):
    """A manifest names a file with an absolute path, ``..``, or another unsafe name."""


class UnsupportedFormatVersion(FormatError):
    """The manifest was written in a format version this ckptvault does not read."""


def is_safe_file_name(name: str) -> bool:
    return bool(_FILE_NAME_RE.match(name)) and name not in RESERVED_NAMES and ".." not in name


@dataclass(frozen=True)
class Manifest:
    run_id: str
    step: int
    generation_id: str
    created_at: str
    parent: str | None
    chunk_size: int
    files: dict[str, FileRecord]
    dcp: dict[str, Any]
    state: dict[str, Any]
    contract: dict[str, Any]
    writer: dict[str, Any] = field(default_factory=dict)
    encryption: EncryptionSection | None = None
    format_version: int = FORMAT_VERSION
    metrics: dict[str, int | float] | None = None
    # (the ``dcp`` object, its canonical bytes): a writer that keeps one layout for
    # many saves encodes that section once. Used only while ``dcp`` is that object.
    encoded_dcp: tuple[dict[str, Any], bytes] | None = field(
        default=None, compare=False, repr=False
    )
    # (the stored bytes, what their MAC covers): kept by parse_manifest for an
    # encrypted manifest, so that checking its MAC parses the bytes no second time.
    parsed_authenticated: tuple[bytes, bytes] | None = field(
        default=None, compare=False, repr=False
    )
    # Format 3: the indexes the root lists, the root's tensor table (set when the
    # indexes are written, or parsed from the root), and the indexes not loaded yet:
    # the files they cover have no chunk digests here, their chunks are not in ``dcp``.
    indexes: dict[str, IndexRecord] | None = None
    tensor_table: TensorTable | None = field(default=None, compare=False, repr=False)
    pending_indexes: frozenset[str] = frozenset()

    @property
    def total_bytes(self) -> int:
        return sum(record.size for record in self.files.values())

    @functools.cached_property
    def chunks_by_file(self) -> dict[str, list[tuple[str, dict[str, Any]]]]:
        """Every chunk ``dcp`` holds, as ``(fqn, chunk)``, by the file it lives in
        (computed once: checks of one file must not walk every chunk of a generation)."""
        found: dict[str, list[tuple[str, dict[str, Any]]]] = {}
        for fqn, info in self.dcp.get("tensors", {}).items():
            for chunk in info["chunks"]:
                found.setdefault(chunk["file"], []).append((fqn, chunk))
        return found

    @property
    def stored_bytes(self) -> int:
        """Bytes of every file the generation lists: its data files and (format 3) its
        indexes; what ``ls`` counts (the manifest and signature aside)."""
        return self.total_bytes + sum(r.size for r in (self.indexes or {}).values())

    @property
    def indexed(self) -> bool:
        """Format 3 or later: a root manifest with per-rank indexes."""
        return self.format_version >= INDEXED_SINCE_FORMAT

    def covers(self, name: str) -> bool:
        """Whether this manifest knows file ``name``'s chunk digests (its index, if
        any, is loaded)."""
        if name not in self.files:
            return False
        if not self.pending_indexes:
            return True
        holder = file_holder(name)
        return holder is None or index_file_name(holder) not in self.pending_indexes

    def to_json(self) -> dict[str, Any]:
        """The manifest document as stored (for format 3, the root), as plain JSON."""
        document = self._document()
        if isinstance(document.get("tensors"), TensorTable):
            document["tensors"] = document["tensors"].to_json()
        return document

    def _document(self) -> dict[str, Any]:
        """:meth:`to_json`, with a root's tensor table left as the object that keeps
        its encoding."""
        if self.indexed:
            return self._root_json()
        document = {
            **self._identity(),
            "files": {name: record.to_json() for name, record in sorted(self.files.items())},
            "dcp": self.dcp,
            "state": self.state,
            "contract": self.contract,
            "writer": self.writer,
        }
        return self._with_optional(document)

    def _identity(self) -> dict[str, Any]:
        """The keys every format version opens with."""
        return {
            "format_version": self.format_version,
            "run_id": self.run_id,
            "step": self.step,
            "generation_id": self.generation_id,
            "created_at": self.created_at,
            "parent": self.parent,
            "chunk_size": self.chunk_size,
        }

    def _root_json(self) -> dict[str, Any]:
        if self.indexes is None or self.tensor_table is None:
            raise FormatError(
                "a format-3 manifest is stored as a root over its indexes: write the indexes "
                "first (ckptvault.saving.indexes.write_indexes)"
            )
        document = {
            **self._identity(),
            "files": {
                name: {"size": record.size, "blake3": record.blake3}
                for name, record in sorted(self.files.items())
            },
            "indexes": {name: record.to_json() for name, record in sorted(self.indexes.items())},
            "tensors": self.tensor_table,  # encoded once, by _encoded_members
            "dcp_version": self.dcp.get("version"),
            "state": self.state,
            "contract": self.contract,
            "writer": self.writer,
        }
        return self._with_optional(document)

    def _with_optional(self, document: dict[str, Any]) -> dict[str, Any]:
        if self.encryption is not None:
            document["encryption"] = self.encryption.to_json()
        if self.metrics is not None:
            document["metrics"] = dict(self.metrics)
        return document

    def authenticated_bytes(self) -> bytes:
        """What the MAC of this manifest covers (see :func:`authenticated_bytes`)."""
        document = self._document()
        members = self._encoded_members(document)
        encryption = document.get("encryption")
        if isinstance(encryption, dict):
            unsealed = {k: v for k, v in encryption.items() if k != MANIFEST_MAC}
            members["encryption"] = dumps_canonical(unsealed)
        return join_canonical_object(members)

    def _encoded_members(self, document: dict[str, Any]) -> dict[str, bytes]:
        """Each top-level member of ``document`` as canonical bytes, each encoded once."""
        encoded = self.encoded_dcp
        reuse = encoded is not None and encoded[0] is self.dcp
        members = {}
        for key, value in document.items():
            if isinstance(value, TensorTable):
                members[key] = value.encoded()
            elif reuse and key == "dcp" and encoded:
                members[key] = encoded[1]
            else:
                members[key] = dumps_canonical(value)
        return members

    def to_bytes(self) -> bytes:
        """Canonical bytes, with the BLAKE3 of everything else as ``manifest_blake3``
        so that corruption of the manifest itself is caught even when unsigned."""
        members = self._encoded_members(self._document())
        digest = blake3(join_canonical_object(members)).hexdigest()
        members[SELF_DIGEST_KEY] = dumps_canonical(digest)
        data = join_canonical_object(members)
        # Never publish what parse_manifest would refuse to read back.
        too_large = indexes_too_large(self.indexes or {})
        if too_large is not None:
            raise FormatError(
                f"the generation's {too_large}. Save fewer, larger tensors, or raise chunk_size"
            )
        limit = MAX_ROOT_BYTES if self.indexed else MAX_MANIFEST_BYTES
        if len(data) > limit:
            raise FormatError(
                f"the manifest would be {len(data)} bytes; ckptvault reads manifests of up to "
                f"{limit} bytes ({limit >> 20} MiB). Keep large values in tensors, not in "
                "JSON leaves, or raise chunk_size so that there are fewer chunk digests"
            )
        refusal = scan_json(data, MAX_MANIFEST_DEPTH)
        if refusal is not None:
            raise FormatError(
                f"the manifest {refusal}; the saved state is nested too deeply to be read back"
            )
        return data


def authenticated_bytes(document: Mapping[str, Any]) -> bytes:
    """The byte string an encrypted manifest's MAC covers.

    It is the canonical JSON (:func:`dumps_canonical`) of the manifest document with
    exactly two keys left out: the top-level self-digest ``manifest_blake3`` (derived
    from everything else, and computed after the MAC) and ``encryption.manifest_mac``
    (the MAC itself). Every other key at every level stays, unknown ones included,
    and so does the wrapped MAC key. The writer computes it from the document it is
    about to publish; a reader from the stored bytes (:func:`stored_authenticated_bytes`).
    Both give the same bytes because the stored manifest must be canonical: one byte
    string per value, so removing two keys and re-serializing is unambiguous.
    """
    body = {key: value for key, value in document.items() if key != SELF_DIGEST_KEY}
    encryption = body.get("encryption")
    if isinstance(encryption, dict):
        body["encryption"] = {k: v for k, v in encryption.items() if k != MANIFEST_MAC}
    return dumps_canonical(body)


def stored_authenticated_bytes(data: bytes, where: str, parsed: Manifest | None = None) -> bytes:
    """:func:`authenticated_bytes` of a stored manifest, from its exact bytes (the
    ones :func:`parse_manifest` accepted, so this parses them the same way). When
    ``parsed`` was parsed from exactly these bytes, what that parse kept is used."""
    kept = parsed.parsed_authenticated if parsed is not None else None
    if kept is not None and (kept[0] is data or kept[0] == data):
        return kept[1]
    raw = loads_canonical(
        data, f"{where}/{MANIFEST_NAME}", max_depth=MAX_MANIFEST_DEPTH, max_bytes=MAX_MANIFEST_BYTES
    )
    if not isinstance(raw, dict):
        raise FormatError(f"{where}: manifest is not a JSON object")
    return authenticated_bytes(raw)


def _require(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in obj:
        raise FormatError(f"{where}: required key {key!r} is missing")
    value = obj[key]
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FormatError(f"{where}: key {key!r} has the wrong type ({type(value).__name__})")
    return value


def check_metrics(value: object, where: str) -> dict[str, int | float]:
    """The ``metrics`` section: at most 256 names (letters, digits, ``_.:/-``, not
    starting with a digit) mapped to finite ints or floats (never bools)."""
    if not isinstance(value, dict):
        raise FormatError(f"{where}: metrics must be an object of name -> number")
    if len(value) > MAX_METRICS:
        raise FormatError(f"{where}: at most {MAX_METRICS} metrics, got {len(value)}")
    checked: dict[str, int | float] = {}
    for name, number in value.items():
        if not isinstance(name, str) or not _METRIC_NAME_RE.match(name):
            raise FormatError(
                f"{where}: metric name {name!r} is not a plain name (letters, digits, _ . : / -, "
                "at most 128, not starting with a digit)"
            )
        if isinstance(number, bool) or not isinstance(number, (int, float)):
            raise FormatError(
                f"{where}: metric {name!r} is {type(number).__name__}, not a plain number"
            )
        if isinstance(number, float) and not math.isfinite(number):
            raise FormatError(f"{where}: metric {name!r} is {number}; only finite numbers")
        if isinstance(number, int) and abs(number) >= _MAX_METRIC_INT:
            raise FormatError(f"{where}: metric {name!r} is out of range (|n| < 2**63)")
        checked[name] = number
    return checked


def check_format_version(version: object, where: str) -> int:
    if not isinstance(version, int) or isinstance(version, bool):
        raise FormatError(f"{where}: format_version is not an integer")
    if version not in READABLE_FORMAT_VERSIONS:
        newest = max(READABLE_FORMAT_VERSIONS)
        if version > newest:
            raise UnsupportedFormatVersion(
                f"{where}: written in format version {version}, but this ckptvault reads "
                f"versions up to {newest}; upgrade ckptvault to restore it"
            )
        raise UnsupportedFormatVersion(
            f"{where}: format version {version} is not one this ckptvault reads"
        )
    return version


def _parse_files(raw_files: dict[str, Any], chunk_size: int, where: str) -> dict[str, FileRecord]:
    """The ``files`` section: plain names only, one digest per chunk."""
    files: dict[str, FileRecord] = {}
    for name, record in raw_files.items():
        if not is_safe_file_name(name):
            raise UnsafeNameError(
                f"{where}: file name {name!r} is not a plain relative name (absolute paths, "
                "'..', hidden and reserved names are refused)"
            )
        files[name] = FileRecord.parse(name, record, where)
        expected_chunks = -(-files[name].size // chunk_size)
        if len(files[name].chunks) != expected_chunks:
            raise FormatError(f"{where}: file {name!r} lists the wrong number of chunk digests")
    return files


def _parse_root_files(raw_files: dict[str, Any], where: str) -> dict[str, FileRecord]:
    """A root's ``files``: plain names, each with exactly a size and a digest (its
    chunk digests are in its index)."""
    files: dict[str, FileRecord] = {}
    for name, record in raw_files.items():
        if not is_safe_file_name(name) or file_holder(name) is None or is_index_file_name(name):
            raise UnsafeNameError(
                f"{where}: file name {name!r} is not a plain relative name of a rank's file "
                "(r<rank>-...; absolute paths, '..', hidden, reserved and index names are "
                "refused)"
            )
        if not isinstance(record, dict) or set(record) != {"size", "blake3"}:
            raise FormatError(f"{where}: entry for file {name!r} must hold exactly size and blake3")
        files[name] = FileRecord.parse(name, {**record, "chunks": []}, where)
    return files


def _parse_indexes(
    raw: dict[str, Any], files: Mapping[str, FileRecord], where: str
) -> dict[str, IndexRecord]:
    """A root's ``indexes``: one per rank that wrote a file, and no other."""
    indexes = {}
    for name, record in raw.items():
        if not is_index_file_name(name):
            raise UnsafeNameError(f"{where}: index name {name!r} is not r<rank>-index.json")
        indexes[name] = IndexRecord.parse(name, record, where)
    needed = {index_file_name(file_holder(name) or 0) for name in files}
    if needed != set(indexes):
        missing, extra = sorted(needed - set(indexes)), sorted(set(indexes) - needed)
        raise FormatError(
            f"{where}: the root lists an index for every rank that wrote a file and no other; "
            f"missing {missing[:5]}, without files {extra[:5]}"
        )
    problem = indexes_too_large(indexes)
    if problem is not None:
        raise FormatError(f"{where}: the root's {problem}; it was not written by ckptvault")
    return indexes


def indexes_too_large(indexes: Mapping[str, IndexRecord]) -> str | None:
    """Why a root may not list these indexes (their sizes add up past
    :data:`~ckptvault.format.index.MAX_INDEXES_TOTAL_BYTES`), or None."""
    total = sum(record.size for record in indexes.values())
    if total <= MAX_INDEXES_TOTAL_BYTES:
        return None
    return (
        f"{len(indexes)} indexes take {total} bytes in all, more than the "
        f"{MAX_INDEXES_TOTAL_BYTES} ({MAX_INDEXES_TOTAL_BYTES >> 30} GiB) a generation's "
        "indexes may take (what a reader that loads them all keeps parsed stays bounded)"
    )


def manifest_too_large(size: int, where: str) -> str:
    return (
        f"{where}: manifest.json is {size} bytes; ckptvault reads manifests of up to "
        f"{MAX_MANIFEST_BYTES} bytes (64 MiB; a 1 TB checkpoint needs about 17 MB), so this "
        "one was not written by ckptvault"
    )


def parse_manifest(data: bytes, where: str) -> Manifest:
    """Parse and validate manifest bytes; ``where`` names the generation for errors.

    Raises :class:`FormatError` for anything malformed, non-canonical, or written by
    a newer format version (the message names both versions).
    """
    if len(data) > MAX_MANIFEST_BYTES:
        raise FormatError(manifest_too_large(len(data), where))
    # One parse, one encoding: each top-level member is encoded once, for the
    # canonical check, the self-digest and an encrypted manifest's MAC.
    raw, members = loads_canonical_members(
        data, f"{where}/{MANIFEST_NAME}", max_depth=MAX_MANIFEST_DEPTH, max_bytes=MAX_MANIFEST_BYTES
    )
    if not isinstance(raw, dict) or members is None:
        raise FormatError(f"{where}: manifest is not a JSON object")
    version = check_format_version(raw.get("format_version"), where)
    authenticated = _check_self_digest(raw, members, where)
    generation_id = _require(raw, "generation_id", str, where)
    if not is_generation_id(generation_id):
        raise FormatError(f"{where}: generation_id {generation_id!r} is malformed")
    step = _require(raw, "step", int, where)
    if not 0 <= step <= MAX_STEP:
        raise FormatError(f"{where}: step {step} is outside 0..{MAX_STEP}")
    parent = raw.get("parent")
    if parent is not None and not isinstance(parent, str):
        raise FormatError(f"{where}: parent must be a generation id or null")
    chunk_size = _require(raw, "chunk_size", int, where)
    if not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise FormatError(f"{where}: chunk_size {chunk_size} is outside 1..{MAX_CHUNK_SIZE}")
    if version >= INDEXED_SINCE_FORMAT:
        if len(data) > MAX_ROOT_BYTES:
            raise FormatError(
                f"{where}: the root manifest is {len(data)} bytes; format {version} roots are "
                f"at most {MAX_ROOT_BYTES} bytes ({MAX_ROOT_BYTES >> 20} MiB)"
            )
        unknown = set(raw) - _ROOT_KEYS
        if unknown:
            raise FormatError(
                f"{where}: the root manifest has keys format {version} does not define: "
                f"{sorted(str(k)[:40] for k in unknown)[:5]}"
            )
        files = _parse_root_files(_require(raw, "files", dict, where), where)
        indexes = _parse_indexes(_require(raw, "indexes", dict, where), files, where)
        holders = sorted(file_holder(name) or 0 for name in indexes)
        table = parse_tensor_table(_require(raw, "tensors", dict, where), holders, where)
        dcp_version = raw.get("dcp_version")
        if dcp_version is not None and not (isinstance(dcp_version, str) and len(dcp_version) < 64):
            raise FormatError(f"{where}: dcp_version must be a short string or null")
        dcp: dict[str, Any] = {"version": dcp_version, "tensors": {}}
    else:
        files = _parse_files(_require(raw, "files", dict, where), chunk_size, where)
        dcp = check_dcp_section(_require(raw, "dcp", dict, where), where)
        indexes, table = None, None
    manifest = Manifest(
        indexes=indexes,
        tensor_table=table,
        pending_indexes=frozenset(indexes or ()),
        format_version=version,
        run_id=_require(raw, "run_id", str, where),
        step=step,
        generation_id=generation_id,
        created_at=_require(raw, "created_at", str, where),
        parent=parent,
        chunk_size=chunk_size,
        files=files,
        dcp=dcp,
        state=_require(raw, "state", dict, where),
        contract=_require(raw, "contract", dict, where),
        writer=_require(raw, "writer", dict, where),
        encryption=(
            EncryptionSection.parse(raw["encryption"], files, where)
            if raw.get("encryption") is not None
            else None
        ),
        metrics=check_metrics(raw["metrics"], where) if raw.get("metrics") is not None else None,
        parsed_authenticated=(data, authenticated) if authenticated is not None else None,
    )
    if manifest.indexed:
        _check_root_round_trip(manifest, raw, where)
    return manifest


def _check_root_round_trip(manifest: Manifest, raw: dict[str, Any], where: str) -> None:
    """A root must be exactly what :meth:`Manifest.to_bytes` writes for what was parsed
    from it (``raw``: its document without the self-digest): no key left out that the
    writer always writes (``parent``, ``dcp_version``), no ``null`` where the writer
    leaves a key out (``encryption``, ``metrics``), no spelling the parsed sections
    drop. So a parsed root's :meth:`Manifest.to_bytes` is its stored bytes: whatever
    rewrites a generation from its parsed manifest writes back the root that was
    checked (and signed), never a different one."""
    document = manifest.to_json()
    if document != raw:
        differing = sorted(
            str(key)[:40]
            for key in set(document) | set(raw)
            if key not in raw or key not in document or raw[key] != document[key]
        )
        raise FormatError(
            f"{where}: the root manifest is not in the form ckptvault writes (it would not be "
            f"written back as it is stored): keys {differing[:5]} differ; it was not written "
            "by ckptvault"
        )


def _check_self_digest(raw: dict[str, Any], members: dict[str, bytes], where: str) -> bytes | None:
    """Take the self-digest out of ``raw`` (parsed manifest) and check it against the
    canonical bytes of the rest (``members``: each member's encoding); for an
    encrypted manifest, return what its MAC covers (:func:`authenticated_bytes`)."""
    recorded = raw.pop(SELF_DIGEST_KEY, None)
    members.pop(SELF_DIGEST_KEY, None)
    if not isinstance(recorded, str):
        raise FormatError(f"{where}: manifest has no {SELF_DIGEST_KEY} self-digest")
    if blake3(join_canonical_object(members)).hexdigest() != recorded:
        raise ManifestDigestError(
            f"{where}: manifest.json does not match its own digest; it was corrupted or edited "
            "after it was written"
        )
    encryption = raw.get("encryption")
    if not isinstance(encryption, dict):
        return None
    unsealed = {key: value for key, value in encryption.items() if key != MANIFEST_MAC}
    return join_canonical_object({**members, "encryption": dumps_canonical(unsealed)})
