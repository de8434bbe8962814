"""The encrypted state file: an encrypted run's non-tensor leaves, out of the manifest.

A plaintext generation keeps its state tree (JSON leaves: step counters, optimizer
hyperparameters, RNG states, NumPy arrays, bytes) in the manifest's ``state`` key.
An encrypted run must not: those leaves can be as sensitive as the weights. So the
tree goes, as canonical JSON, into ``r<rank>-state.json.enc``, an encrypted
container like the tensor files (its own data key, wrapped by the run's KEK, bound
to run, generation and file name), listed and hashed in the manifest like any
other file. The manifest's ``state`` then only says where it is::

    "state": {"$encrypted_file": "r00000-state.json.enc"}

Anyone can verify its digests without the key; only a key holder reads it.
"""

from __future__ import annotations

from typing import Any

from ckptvault.errors import FormatError
from ckptvault.format.canonical import dumps_canonical, loads_canonical
from ckptvault.format.layout import (  # re-exported: where the state file is named
    ENCRYPTED_STATE_TAG,
    encrypted_state_reference,
)
from ckptvault.format.manifest import Manifest
from ckptvault.format.records import FileRecord
from ckptvault.io.writer import HashingSink
from ckptvault.storage.base import GenerationRef, StagingArea, Store
from ckptvault.trust.digests import ChunkVerifier, FileDigester, read_full
from ckptvault.trust.envelope import EncryptingWriter, FileEncryption, SegmentDecryptor, binding

__all__ = [
    "ENCRYPTED_STATE_TAG",
    "encrypted_state_reference",
    "read_state_file",
    "write_state_file",
]

MAX_STATE_FILE_BYTES = 256 * 1024 * 1024  # JSON leaves; tensors live elsewhere


def write_state_file(
    staging: StagingArea,
    name: str,
    tree: dict[str, Any],
    chunk_size: int,
    encryption: FileEncryption,
) -> tuple[FileRecord, tuple[str, bytes]]:
    """Encrypt ``tree`` into ``name``; returns its record and (KEK id, wrapped key)."""
    data = dumps_canonical(tree)
    digester = FileDigester(chunk_size)
    sink = staging.create_file(name)
    try:
        data_key, kek_id, wrapped = encryption.new_file_key(name)
        out = EncryptingWriter(
            HashingSink(sink, digester),
            data_key,
            encryption.context(name),
            encryption.segment_size,
            len(data),
            where=name,
        )
        out.write(data)
        out.close()
    except BaseException:
        sink.abort()
        raise
    sink.commit()
    return digester.finish(), (kek_id, wrapped)


def read_state_file(
    store: Store, ref: GenerationRef, manifest: Manifest, name: str, data_key: bytes
) -> dict[str, Any]:
    """Verify every chunk of ``name`` against the manifest, decrypt it, parse it.

    Raises IntegrityError (digests), DecryptionError (authentication) or FormatError.
    """
    record = manifest.files.get(name)
    if record is None:
        raise FormatError(f"the encrypted state file {name} is not listed in the manifest")
    if record.size > MAX_STATE_FILE_BYTES:
        raise FormatError(f"{name} is larger than {MAX_STATE_FILE_BYTES} bytes")
    plain = bytearray()
    context = binding(manifest.run_id, manifest.generation_id, name)
    decryptor = SegmentDecryptor(
        data_key, context, name, lambda _offset, piece: plain.extend(piece)
    )
    verifier = ChunkVerifier(record, manifest.chunk_size, name, whole_file=False)
    buffer = memoryview(bytearray(manifest.chunk_size))
    position = 0
    with store.open_file(ref, name) as stream:
        while position < record.size:
            count = read_full(stream, buffer[: min(manifest.chunk_size, record.size - position)])
            if count == 0:
                break
            verifier.update(buffer[:count])  # raises before any byte is decrypted
            decryptor.feed(buffer[:count])
            position += count
    verifier.finish()
    decryptor.finish()
    tree = loads_canonical(bytes(plain), name)
    if not isinstance(tree, dict):
        raise FormatError(f"{name} does not hold a state tree")
    return tree
