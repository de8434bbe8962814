"""Store records on a POSIX filesystem: ``.records/<kind>/<name>.json``.

What records are, and why one may only ever withhold a generation from restore or
keep one from deletion, is :mod:`ckptvault.storage.records`. Here they are reached
like everything else below the store's root: by directory descriptor, links
refused. A record is written to a temporary file, fsync'd and renamed into place,
so a reader sees the old record or the new one; one that cannot be read or parsed
is skipped when listing.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from typing import Any

from ckptvault.durable import make_dirs_durable
from ckptvault.errors import UnsafeEntryError
from ckptvault.storage.posix.files import (
    PosixRoot,
    PosixWritableFile,
    open_dir,
    opened,
    read_small_file,
)
from ckptvault.storage.records import (
    MAX_RECORD_BYTES,
    RECORD_SUFFIX,
    RECORDS_DIR,
    RecordFilter,
    check_record_key,
    decode_record,
    encode_record,
    record_name_of,
    records_to_read,
)


def records_dir(store: PosixRoot, kind: str, create: bool) -> int | None:
    """``.records/<kind>`` by descriptor (links refused); None when absent."""
    where = os.path.join(store.location, RECORDS_DIR)
    with opened(store.open_root()) as root_fd:
        if create:
            _make_durable_dir(root_fd, RECORDS_DIR)
        try:
            records_fd = open_dir(RECORDS_DIR, root_fd, where)
        except FileNotFoundError:
            return None
    with opened(records_fd):
        if create:
            _make_durable_dir(records_fd, kind)
        try:
            return open_dir(kind, records_fd, os.path.join(where, kind))
        except FileNotFoundError:
            return None


def _make_durable_dir(parent_fd: int, name: str) -> None:
    """``mkdir`` that a power cut cannot take back: a record written into it (a pin,
    say) is only as durable as the directories that lead to it."""
    try:
        os.mkdir(name, 0o755, dir_fd=parent_fd)
    except FileExistsError:
        return
    os.fsync(parent_fd)


def put_record(store: PosixRoot, kind: str, name: str, data: dict[str, Any]) -> None:
    check_record_key(kind, name)
    encoded = encode_record(data)
    make_dirs_durable(store.root)
    kind_fd = records_dir(store, kind, create=True)
    assert kind_fd is not None  # created above
    with opened(kind_fd):
        temporary = f".{name}.{secrets.token_hex(6)}.tmp"
        record = PosixWritableFile(kind_fd, temporary, os.path.join(store.location, name))
        try:
            record.write(encoded)
            record.commit()
            os.rename(temporary, name + RECORD_SUFFIX, src_dir_fd=kind_fd, dst_dir_fd=kind_fd)
            os.fsync(kind_fd)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary, dir_fd=kind_fd)


def list_records(
    store: PosixRoot, kind: str, accept: RecordFilter | None = None, limit: int | None = None
) -> dict[str, dict[str, Any]]:
    check_record_key(kind, "x")
    kind_fd = records_dir(store, kind, create=False)
    if kind_fd is None:
        return {}
    records = {}
    with opened(kind_fd):
        listed = [name for entry in os.listdir(kind_fd) if (name := record_name_of(entry))]
        where = os.path.join(store.location, RECORDS_DIR, kind)
        for name in records_to_read(listed, kind, where, accept, limit):
            file_name = name + RECORD_SUFFIX
            try:
                raw = read_small_file(kind_fd, file_name, MAX_RECORD_BYTES)
            except (OSError, UnsafeEntryError):
                continue
            data = decode_record(raw, os.path.join(store.location, RECORDS_DIR, kind, file_name))
            if data is not None:
                records[name] = data
    return records


def delete_record(store: PosixRoot, kind: str, name: str) -> None:
    check_record_key(kind, name)
    kind_fd = records_dir(store, kind, create=False)
    if kind_fd is None:
        return
    with opened(kind_fd), contextlib.suppress(FileNotFoundError):
        os.unlink(name + RECORD_SUFFIX, dir_fd=kind_fd)
        os.fsync(kind_fd)
