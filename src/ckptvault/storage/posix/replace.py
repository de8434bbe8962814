"""Replacing a published generation's manifest on POSIX (key rotation, signing).

A published generation is never modified, with one exception: key rotation
(``ckptvault.ops.rotation.rotate``) rewrites the key wrapping in its manifest, and so the
manifest's bytes and signature. Data files are never touched. The order:

1. the stored manifest is read (by descriptor, no link followed) and must be exactly
   the bytes the caller verified; otherwise nothing is written;
2. the new signature and manifest are written under private names in the store's
   ``.staging`` directory (never in the generation: a stray name there would make it
   fail the file-set check) and fsync'd;
3. the signature is renamed over ``manifest.sig``, then the manifest over
   ``manifest.json`` (same filesystem: each rename is atomic), and the generation
   directory is fsync'd after each.

A crash leaves the old pair, the new signature beside the old manifest (a signature
check refuses it until the rotation resumes and finishes it), or the new pair; a
temporary file left in ``.staging`` is a leftover that ``remove_stale_staging``
removes like any other.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets

from ckptvault.errors import IntegrityError, UsageError
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME
from ckptvault.storage.base import GenerationRef
from ckptvault.storage.posix.files import PosixWritableFile, read_small_file, translate_os_error


def replace_manifest_files(
    generation_fd: int,
    staging_fd: int,
    ref: GenerationRef,
    manifest: bytes,
    signature: bytes | None,
    replaces: bytes,
) -> None:
    """Steps 1-3 of the module docstring, given the generation's and ``.staging``'s
    directory descriptors."""
    where = os.path.join(ref.location, MANIFEST_NAME)
    try:
        try:
            current = read_small_file(generation_fd, MANIFEST_NAME, len(replaces))
        except OSError as exc:
            if exc.errno != errno.EFBIG:
                raise
            current = None
        if current != replaces:
            raise IntegrityError(
                f"{where} is not the manifest that was verified (it changed meanwhile); "
                "nothing was replaced. Verify the generation again"
            )
        if signature is None and _exists(generation_fd, SIGNATURE_NAME):
            raise UsageError(
                f"{ref.location} is signed: replacing its manifest needs a new signature, or "
                "the old one would be left over other bytes"
            )
        token = secrets.token_hex(6)
        pending = [
            (f"{ref.generation_id}.{name}.{token}.replacing", name, data)
            for name, data in ((SIGNATURE_NAME, signature), (MANIFEST_NAME, manifest))
            if data is not None
        ]
        try:
            for temporary, _name, data in pending:
                _write_durably(staging_fd, temporary, data, os.path.join(ref.location, _name))
            for temporary, name, _data in pending:  # the signature first
                os.rename(temporary, name, src_dir_fd=staging_fd, dst_dir_fd=generation_fd)
                os.fsync(generation_fd)
            os.fsync(staging_fd)
        finally:
            for temporary, _name, _data in pending:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(temporary, dir_fd=staging_fd)
    except OSError as exc:
        raise translate_os_error(exc, f"replacing {where}") from exc


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _write_durably(dir_fd: int, name: str, data: bytes, where: str) -> None:
    new = PosixWritableFile(dir_fd, name, where)
    try:
        new.write(data)
    except BaseException:
        new.abort()
        raise
    new.commit()  # read-only, fsync'd
