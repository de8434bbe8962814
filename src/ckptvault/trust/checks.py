"""The checks a generation must pass before any of its bytes is used.

Two stages, both free of torch so the CLI can run them:

- :func:`check_structure` — cheap: the generation is a plain directory, the manifest
  parses (canonical, supported format version), names this run and matches the
  directory name; the set of files on disk equals the manifest's set, sizes match,
  every tensor file's header parses and agrees with where the manifest says each
  tensor chunk lives.
- :func:`check_digests` — every byte: each file's chunk digests and whole-file
  digest. Restore does this stage while it reads (see ``ckptvault.io.reader``).

Each failed rule is a :class:`Problem` with its own ``code``; a restore skips a
generation with the problems joined into one reason string.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ckptvault.errors import CheckpointError, FormatError, IntegrityError
from ckptvault.format.layout import MANIFEST_NAME, TENSOR_FILE_SUFFIX
from ckptvault.format.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from ckptvault.format.tensorfile import TensorFileHeader, header_length, parse_header
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.digests import verify_stream

# Problem codes: one per rule, stable for tooling.
MANIFEST_MISSING = "manifest-missing"
MANIFEST_INVALID = "manifest-invalid"
FORMAT_UNSUPPORTED = "format-unsupported"
NAME_MISMATCH = "name-mismatch"
RUN_MISMATCH = "run-mismatch"
FILE_MISSING = "file-missing"
FILE_EXTRA = "file-extra"
FILE_SIZE = "size-mismatch"
DIGEST_MISMATCH = "digest-mismatch"
UNSAFE_ENTRY = "unsafe-entry"
TENSOR_FILE_INVALID = "tensor-file-invalid"
MANIFEST_INCONSISTENT = "manifest-inconsistent"
UNREADABLE = "unreadable"


@dataclass(frozen=True)
class Problem:
    code: str
    detail: str
    file: str | None = None

    def __str__(self) -> str:
        return f"{self.code}: {self.detail}"


class GenerationRejected(CheckpointError):
    """A candidate generation failed a check; restore skips it and tries the next."""

    def __init__(self, ref: GenerationRef, problems: list[Problem]) -> None:
        self.ref = ref
        self.problems = problems
        super().__init__(f"generation {ref.generation_id} (step {ref.step}): {self.reason}")

    @property
    def reason(self) -> str:
        return "; ".join(str(p) for p in self.problems)


@dataclass
class CheckedGeneration:
    """A generation whose structure passed; its bytes are not yet hashed."""

    ref: GenerationRef
    manifest: Manifest
    headers: dict[str, TensorFileHeader] = field(default_factory=dict)


def check_structure(
    store: Store, ref: GenerationRef, expected_run_id: str | None = None
) -> CheckedGeneration:
    """Run every structural rule; raise :class:`GenerationRejected` listing failures."""
    where = f"generation {ref.generation_id} (step {ref.step})"
    try:
        kind = store.generation_kind(ref)
        if kind != "dir":
            raise GenerationRejected(
                ref, [Problem(UNSAFE_ENTRY, f"{ref.location} is a {kind}, not a directory")]
            )
        entries = store.list_entries(ref)
    except OSError as exc:
        raise GenerationRejected(
            ref, [Problem(UNREADABLE, f"cannot list {ref.location}: {exc}")]
        ) from exc

    manifest_entry = entries.get(MANIFEST_NAME)
    if manifest_entry is None:
        raise GenerationRejected(ref, [Problem(MANIFEST_MISSING, f"{MANIFEST_NAME} is missing")])
    if manifest_entry.kind != "file" or manifest_entry.links != 1:
        raise GenerationRejected(
            ref, [Problem(UNSAFE_ENTRY, f"{MANIFEST_NAME} is not a plain file", MANIFEST_NAME)]
        )
    try:
        manifest = parse_manifest(store.read_bytes(ref, MANIFEST_NAME, MAX_MANIFEST_BYTES), where)
    except FormatError as exc:
        code = FORMAT_UNSUPPORTED if "format version" in str(exc) else MANIFEST_INVALID
        raise GenerationRejected(ref, [Problem(code, str(exc), MANIFEST_NAME)]) from exc
    except OSError as exc:
        raise GenerationRejected(
            ref, [Problem(UNREADABLE, f"cannot read manifest: {exc}")]
        ) from exc

    problems: list[Problem] = []
    if (manifest.step, manifest.generation_id) != (ref.step, ref.generation_id):
        problems.append(
            Problem(
                NAME_MISMATCH,
                f"directory says step {ref.step} / {ref.generation_id} but the manifest says "
                f"step {manifest.step} / {manifest.generation_id}",
            )
        )
    if expected_run_id is not None and manifest.run_id != expected_run_id:
        problems.append(
            Problem(
                RUN_MISMATCH, f"manifest is for run {manifest.run_id!r}, not {expected_run_id!r}"
            )
        )
    problems.extend(_check_file_set(manifest, entries))
    if problems:
        raise GenerationRejected(ref, problems)

    checked = CheckedGeneration(ref=ref, manifest=manifest)
    problems.extend(_check_tensor_files(store, checked))
    if problems:
        raise GenerationRejected(ref, problems)
    return checked


def _check_file_set(manifest: Manifest, entries: dict[str, Any]) -> list[Problem]:
    problems = []
    allowed = set(manifest.files) | {MANIFEST_NAME}
    for name in sorted(set(manifest.files) - set(entries)):
        problems.append(
            Problem(FILE_MISSING, f"{name} is listed in the manifest but missing", name)
        )
    for name in sorted(set(entries) - allowed):
        problems.append(Problem(FILE_EXTRA, f"{name} is not listed in the manifest", name))
    for name in sorted(set(entries) & set(manifest.files)):
        entry, record = entries[name], manifest.files[name]
        if entry.kind != "file":
            problems.append(
                Problem(UNSAFE_ENTRY, f"{name} is a {entry.kind}, not a plain file", name)
            )
        elif entry.links != 1:
            problems.append(
                Problem(UNSAFE_ENTRY, f"{name} is hard-linked ({entry.links} names share it)", name)
            )
        elif entry.size != record.size:
            problems.append(
                Problem(
                    FILE_SIZE,
                    f"{name} has {entry.size} bytes, the manifest records {record.size} "
                    "(truncated or extended)",
                    name,
                )
            )
    return problems


def _check_tensor_files(store: Store, checked: CheckedGeneration) -> list[Problem]:
    """Parse every tensor file's header and tie it to the manifest's DCP chunks."""
    manifest, ref = checked.manifest, checked.ref
    problems = []
    for name, record in sorted(manifest.files.items()):
        if not name.endswith(TENSOR_FILE_SUFFIX):
            problems.append(
                Problem(TENSOR_FILE_INVALID, f"{name} is not a format ckptvault writes", name)
            )
            continue
        try:
            with store.open_file(ref, name) as stream:
                prefix = stream.read(8)
                total = header_length(prefix, record.size, name)
                header = prefix + stream.read(total - len(prefix))
            checked.headers[name] = parse_header(header, record.size, name)
        except FormatError as exc:
            problems.append(Problem(TENSOR_FILE_INVALID, str(exc), name))
        except OSError as exc:
            problems.append(Problem(UNREADABLE, f"cannot read {name}: {exc}", name))
    if problems:
        return problems
    return _check_chunk_locations(manifest, checked.headers)


def _check_chunk_locations(
    manifest: Manifest, headers: dict[str, TensorFileHeader]
) -> list[Problem]:
    problems = []
    try:
        tensors = manifest.dcp["tensors"]
        for fqn, info in tensors.items():
            for chunk in info["chunks"]:
                file, name = chunk["file"], chunk["name"]
                entry = headers.get(file)
                found = entry.entries.get(name) if entry else None
                if (
                    found is None
                    or found.start != chunk["start"]
                    or found.nbytes != chunk["length"]
                    or found.dtype != info["dtype"]
                    or list(found.shape) != list(chunk["sizes"])
                ):
                    problems.append(
                        Problem(
                            MANIFEST_INCONSISTENT,
                            f"tensor {fqn!r} chunk {chunk['offsets']} is not where the manifest "
                            f"says ({file}:{name})",
                            file,
                        )
                    )
    except (KeyError, TypeError, AttributeError) as exc:
        problems.append(Problem(MANIFEST_INVALID, f"dcp metadata is malformed ({exc!r})"))
    return problems


def check_digests(
    store: Store,
    checked: CheckedGeneration,
    on_bytes: Callable[[int], None] | None = None,
) -> list[Problem]:
    """Hash every byte of every file against the manifest."""
    manifest, ref = checked.manifest, checked.ref
    problems = []
    for name, record in sorted(manifest.files.items()):
        try:
            with store.open_file(ref, name) as stream:
                verify_stream(stream, record, manifest.chunk_size, name, on_bytes)
        except IntegrityError as exc:
            problems.append(Problem(DIGEST_MISMATCH, str(exc), name))
        except OSError as exc:
            problems.append(Problem(UNREADABLE, f"cannot read {name}: {exc}", name))
    return problems


@dataclass
class VerificationReport:
    ref: GenerationRef
    problems: list[Problem]
    manifest: Manifest | None = None

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_generation(
    store: Store,
    ref: GenerationRef,
    expected_run_id: str | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> VerificationReport:
    """Every rule, every byte; never raises for a bad generation, reports it."""
    try:
        checked = check_structure(store, ref, expected_run_id)
    except GenerationRejected as rejected:
        return VerificationReport(ref, rejected.problems)
    return VerificationReport(ref, check_digests(store, checked, on_bytes), checked.manifest)
