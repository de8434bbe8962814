"""Rule 6 of the restore checks: every file is one of ckptvault's own formats.

A plain file must be a safetensors tensor file whose header agrees with the
manifest; an encrypted one must be a container (of a tensor file or of the state
file) with a wrapped key. Headers are bounded and checked against the manifest's
chunk digests before they are parsed, and the chunks the manifest places in each
file must lie where the file says (``trust.chunk_layout``). Nothing here needs a key.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from functools import partial

from ckptvault.errors import FormatError, IntegrityError, UnsafeEntryError
from ckptvault.format.container import (
    CONTAINER_PREFIX_BYTES,
    container_header_length,
    parse_container_header,
)
from ckptvault.format.layout import TENSOR_FILE_SUFFIX, is_encrypted_name, is_tensor_file_name
from ckptvault.format.manifest import Manifest
from ckptvault.format.tensorfile import (
    HEADER_LENGTH_BYTES,
    TensorFileHeader,
    header_length,
    header_size_limit,
    parse_header,
)
from ckptvault.storage.base import GenerationRef, Store
from ckptvault.trust.chunk_layout import check_chunk_layout
from ckptvault.trust.digests import read_verified_head
from ckptvault.trust.problems import (
    DIGEST_MISMATCH,
    MANIFEST_INCONSISTENT,
    TENSOR_FILE_INVALID,
    UNKNOWN_FORMAT,
    UNREADABLE,
    UNSAFE_ENTRY,
    Problem,
)


def check_own_formats(
    store: Store, ref: GenerationRef, manifest: Manifest, names: Collection[str] | None = None
) -> tuple[list[Problem], dict[str, TensorFileHeader]]:
    """Every file (or those ``names``: the files of the indexes just loaded) must parse
    as a tensor file or an encrypted container, and hold its chunks where they lie.

    A header is bounded and verified before it is parsed: a tensor file's may be no
    larger than the entries the manifest places in it need (``header_size_limit``),
    a container's no larger than ``MAX_HEADER``, and its bytes must match the
    manifest's digests of the chunks that hold them (``digest-mismatch``).
    """
    headers: dict[str, TensorFileHeader] = {}
    encrypted = manifest.encryption.wrapped_keys if manifest.encryption else {}
    entry_names = {
        file: [chunk["name"] for _fqn, chunk in chunks]
        for file, chunks in manifest.chunks_by_file.items()
    }
    regions: dict[str, tuple[int, int]] = {}  # where each tensor file holds tensor bytes
    problems = []
    checking = set(manifest.files) if names is None else set(names)
    for name, record in sorted(manifest.files.items()):
        if name not in checking:
            continue
        try:
            if is_encrypted_name(name):
                if name not in encrypted:
                    problems.append(
                        Problem(MANIFEST_INCONSISTENT, f"{name} has no wrapped key", name)
                    )
                    continue
                length_of = partial(container_header_length, where=name)
                header = _verified_head(
                    store, ref, manifest, name, CONTAINER_PREFIX_BYTES, length_of
                )
                container = parse_container_header(header, record.size, name)
                if is_tensor_file_name(name):
                    regions[name] = (HEADER_LENGTH_BYTES, container.plaintext_size)
            elif name.endswith(TENSOR_FILE_SUFFIX):
                limit = header_size_limit(entry_names.get(name, ()))
                length_of = partial(header_length, file_size=record.size, where=name, limit=limit)
                header = _verified_head(store, ref, manifest, name, HEADER_LENGTH_BYTES, length_of)
                parsed = parse_header(header, record.size, name, limit)
                headers[name] = parsed
                regions[name] = (parsed.data_start, record.size)
            else:
                problems.append(
                    Problem(UNKNOWN_FORMAT, f"{name} is not a format ckptvault writes", name)
                )
        except FormatError as exc:
            problems.append(Problem(TENSOR_FILE_INVALID, str(exc), name))
        except UnsafeEntryError as exc:
            problems.append(Problem(UNSAFE_ENTRY, str(exc), name))
        except IntegrityError as exc:
            problems.append(Problem(DIGEST_MISMATCH, str(exc), name))
        except OSError as exc:
            problems.append(Problem(UNREADABLE, f"cannot read {name}: {exc}", name))
    if problems:
        return problems, headers
    return check_chunk_layout(manifest, headers, regions, checking), headers


def _verified_head(
    store: Store,
    ref: GenerationRef,
    manifest: Manifest,
    name: str,
    probe: int,
    length_of: Callable[[bytes], int],
) -> bytes:
    """A file's header bytes, checked against the manifest's chunk digests."""
    record, chunk_size = manifest.files[name], manifest.chunk_size
    with store.open_file(ref, name) as stream:
        return read_verified_head(stream, record, chunk_size, name, probe, length_of)
