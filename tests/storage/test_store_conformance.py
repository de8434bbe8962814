"""Store conformance suite: what every storage backend must do.

Each behaviour test runs once per entry of :data:`BACKENDS` and talks to the store
only through the protocols of :mod:`ckptvault.storage.base` (no paths, no os calls),
so it runs unchanged against any backend. A new backend joins with one entry::

    BACKENDS["s3"] = Backend(make=make_s3_store, entry_saboteurs={...}, ...)

``make(base)`` returns a fresh, empty store (``base`` is a fresh, empty local
directory it may use, for example to name a unique bucket prefix). Tests that need
a hostile entry planted in the store use the backend's *saboteurs*: small,
backend-specific helpers registered beside the factory. A backend that cannot hold
such an entry (an object store has no FIFO or hard link) leaves it out, and the case
is skipped as not applicable to it. The S3 backend runs twice: against moto
(``support/s3_server.py``) and against SeaweedFS, a real S3-compatible server
(``support/seaweedfs_server.py``); its saboteurs are in ``support/s3_saboteurs.py``.
The Azure Blob backend runs against Azurite, Microsoft's
emulator (``support/azurite_server.py``); its saboteurs are in
``support/azure_saboteurs.py``.

The last few tests cover :func:`ckptvault.storage.open_store` on local paths and
URLs; ``open_store(store.location)`` itself is checked for every backend.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from ckptvault.errors import (
    CheckpointError,
    IntegrityError,
    StoreLockedError,
    UnsafeEntryError,
    UsageError,
)
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME, new_generation_id
from ckptvault.storage import open_store
from ckptvault.storage.base import EntryInfo, GenerationRef, StagingArea, Store
from ckptvault.storage.posix.store import PosixStore
from support.azure_saboteurs import AZURE_ENTRY_SABOTEURS, AZURE_STORE_SABOTEURS, make_azure_store
from support.common import REPO
from support.s3_saboteurs import (
    S3_ENTRY_SABOTEURS,
    S3_STORE_SABOTEURS,
    make_s3_store,
    make_seaweedfs_store,
)

# A saboteur plants something hostile and returns a check that everything outside
# the store it pointed at is still exactly as it was (nothing written, deleted).
Untouched = Callable[[], None]
EntrySaboteur = Callable[[Store, GenerationRef, str], Untouched]
GenerationSaboteur = Callable[[Store, GenerationRef], Untouched]
StoreSaboteur = Callable[[Store], Untouched]


@dataclass(frozen=True)
class Backend:
    """One storage backend under test."""

    make: Callable[[Path], Store]  # a fresh, empty store (not created yet)
    # Hostile entries planted inside a published generation, by kind: "symlink",
    # "fifo", "hardlink", "directory"; for object stores also "duplicate" (a second
    # copy under another key prefix) and "misplaced" (under a prefix never used).
    entry_saboteurs: Mapping[str, EntrySaboteur] = field(default_factory=dict)
    # The generation itself replaced by something else: "symlink", "file".
    generation_saboteurs: Mapping[str, GenerationSaboteur] = field(default_factory=dict)
    # The store's own control entries replaced: "staging_symlink", "lock_symlink",
    # "lock_garbage"; "stale_staging_links": staging leftovers that are (or hold)
    # links out of the store.
    store_saboteurs: Mapping[str, StoreSaboteur] = field(default_factory=dict)
    # Where a store keeps its bytes on the local filesystem, for holds_path; None for
    # a backend that holds no local path at all (an object store).
    local_root: Callable[[Store], Path] | None = None
    # True: remove_stale_staging() without an age removes every leftover, and only
    # under the writer lock (POSIX). False: without an age it removes nothing and
    # needs no lock (no lock proves an object store's upload dead); leftovers then
    # go with remove_stale_staging(older_than=0).
    cleanup_needs_lock: bool = True
    # pytest fixtures the backend needs (a server, say), requested before make().
    fixtures: tuple[str, ...] = ()


# -- the POSIX backend and its saboteurs --------------------------------------------

SECRET = b"bytes outside the store that must never be served, changed or deleted"


def _posix_root(store: Store) -> Path:
    return Path(store.location)


def _outside(store: Store, name: str) -> Path:
    """A path beside (not inside) the store's directory."""
    return _posix_root(store).parent / f"outside-{name}"


def _file_kept(path: Path, data: bytes) -> Untouched:
    def check() -> None:
        assert path.is_file() and not path.is_symlink(), f"{path} was removed or replaced"
        assert path.read_bytes() == data, f"{path} was written through the store"

    return check


def _tree_kept(root: Path) -> Untouched:
    before = {p.relative_to(root): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}
    dirs = sorted(p.relative_to(root) for p in root.rglob("*") if p.is_dir())

    def check() -> None:
        after = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
        assert after == before, f"files under {root} changed"
        assert sorted(p.relative_to(root) for p in root.rglob("*") if p.is_dir()) == dirs

    return check


def _posix_plant_symlink(store: Store, ref: GenerationRef, name: str) -> Untouched:
    target = _outside(store, name)
    target.write_bytes(SECRET)
    (Path(ref.location) / name).symlink_to(target)
    return _file_kept(target, SECRET)


def _posix_plant_fifo(store: Store, ref: GenerationRef, name: str) -> Untouched:
    os.mkfifo(Path(ref.location) / name)
    return lambda: None


def _posix_plant_hardlink(store: Store, ref: GenerationRef, name: str) -> Untouched:
    target = _outside(store, name)
    target.write_bytes(SECRET)
    os.link(target, Path(ref.location) / name)
    return _file_kept(target, SECRET)


def _posix_plant_directory(store: Store, ref: GenerationRef, name: str) -> Untouched:
    nested = Path(ref.location) / name
    nested.mkdir()
    (nested / "inner.bin").write_bytes(SECRET)
    return lambda: None


def _posix_generation_symlink(store: Store, ref: GenerationRef) -> Untouched:
    """Move the generation out of the store and leave a link to it in its place."""
    real = Path(ref.location)
    moved = _outside(store, "generation")
    real.rename(moved)
    real.symlink_to(moved, target_is_directory=True)
    return _tree_kept(moved)


def _posix_generation_file(store: Store, ref: GenerationRef) -> Untouched:
    real = Path(ref.location)
    shutil.rmtree(real)
    real.write_bytes(SECRET)
    return lambda: None


def _posix_staging_symlink(store: Store) -> Untouched:
    """``.staging`` points at a directory outside the store holding what looks like
    a stale staging area; cleanup must not delete it, saves must not write there."""
    root = _posix_root(store)
    root.mkdir(parents=True, exist_ok=True)
    victim = _outside(store, "staging")
    (victim / new_generation_id()).mkdir(parents=True)
    (victim / "precious.txt").write_bytes(SECRET)
    (root / ".staging").symlink_to(victim, target_is_directory=True)
    return _tree_kept(victim)


def _posix_stale_staging_links(store: Store) -> Untouched:
    """Leftovers that are links out of the store: a staging area that is a link, and
    a link inside a real staging area. Cleanup must unlink them, not follow them."""
    root = _posix_root(store)
    victim = _outside(store, "cleanup")
    (victim / "nested").mkdir(parents=True)
    (victim / "precious.txt").write_bytes(SECRET)
    (victim / "nested" / "precious.txt").write_bytes(SECRET)
    staging = root / ".staging"
    staging.mkdir(parents=True)
    (staging / new_generation_id()).symlink_to(victim, target_is_directory=True)
    real = staging / new_generation_id()
    real.mkdir()
    (real / "a.bin").write_bytes(b"leftover")
    (real / "escape").symlink_to(victim, target_is_directory=True)
    (real / "escape-file").symlink_to(victim / "precious.txt")
    return _tree_kept(victim)


def _posix_lock_garbage(store: Store) -> Untouched:
    root = _posix_root(store)
    root.mkdir(parents=True, exist_ok=True)
    (root / ".writer.lock").write_bytes(b"\xff{" * (512 * 1024))
    return lambda: None


def _posix_lock_symlink(store: Store) -> Untouched:
    root = _posix_root(store)
    root.mkdir(parents=True, exist_ok=True)
    victim = _outside(store, "lock")
    victim.write_bytes(SECRET)
    (root / ".writer.lock").symlink_to(victim)
    return _file_kept(victim, SECRET)


POSIX = Backend(
    make=lambda base: PosixStore(base / "store"),
    entry_saboteurs={
        "symlink": _posix_plant_symlink,
        "fifo": _posix_plant_fifo,
        "hardlink": _posix_plant_hardlink,
        "directory": _posix_plant_directory,
    },
    generation_saboteurs={"symlink": _posix_generation_symlink, "file": _posix_generation_file},
    store_saboteurs={
        "staging_symlink": _posix_staging_symlink,
        "lock_symlink": _posix_lock_symlink,
        "lock_garbage": _posix_lock_garbage,
        "stale_staging_links": _posix_stale_staging_links,
    },
    local_root=_posix_root,
)

BACKENDS: dict[str, Backend] = {
    "posix": POSIX,
    "s3": Backend(
        make=make_s3_store,
        entry_saboteurs=S3_ENTRY_SABOTEURS,
        store_saboteurs=S3_STORE_SABOTEURS,
        cleanup_needs_lock=False,
        fixtures=("s3_endpoint",),
    ),
    # The same S3 backend on SeaweedFS, a real S3-compatible server
    # (tests/support/seaweedfs_server.py): each test's stores under a prefix of their
    # own in the server's session bucket.
    "seaweedfs": Backend(
        make=make_seaweedfs_store,
        entry_saboteurs=S3_ENTRY_SABOTEURS,
        store_saboteurs=S3_STORE_SABOTEURS,
        cleanup_needs_lock=False,
        fixtures=("seaweedfs_env",),
    ),
    # Azure Blob on Azurite (tests/support/azurite_server.py); azure_env points
    # AZURE_STORAGE_CONNECTION_STRING at it for the test.
    "azure": Backend(
        make=make_azure_store,
        entry_saboteurs=AZURE_ENTRY_SABOTEURS,
        store_saboteurs=AZURE_STORE_SABOTEURS,
        cleanup_needs_lock=False,
        fixtures=("azure_env",),
    ),
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request: pytest.FixtureRequest) -> Backend:
    chosen = BACKENDS[request.param]
    for name in chosen.fixtures:
        request.getfixturevalue(name)
    return chosen


def assert_cleanup_without_age(backend: Backend, store: Store) -> None:
    """remove_stale_staging() by a store that does not hold the writer lock."""
    if backend.cleanup_needs_lock:
        with pytest.raises(UsageError):
            store.remove_stale_staging()
    else:
        assert store.remove_stale_staging() == []


@pytest.fixture
def backend_store(backend: Backend, tmp_path: Path) -> Iterator[Store]:
    """A fresh, empty store of each backend (released if a test left it locked)."""
    base = tmp_path / "base"
    base.mkdir()
    store = backend.make(base)
    yield store
    store.release_writer()


def _another_store(backend: Backend, tmp_path: Path, name: str) -> Store:
    base = tmp_path / name
    base.mkdir()
    return backend.make(base)


# -- protocol-only helpers ----------------------------------------------------------

MiB = 1024 * 1024
MANIFEST = b'{"format": "conformance-test", "files": "whatever the writer says"}'
SIGNATURE = b"\x00signature bytes\xff"


def payload(size: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(size)


def write_file(area: StagingArea, name: str, data: bytes, chunk: int = MiB) -> None:
    """Write ``data`` in pieces of every accepted buffer type, then commit."""
    sink = area.create_file(name)
    try:
        kinds = (bytes, bytearray, memoryview)
        for index, start in enumerate(range(0, len(data), chunk)):
            piece = data[start : start + chunk]
            buffer = kinds[index % 3](piece)
            assert sink.write(buffer) == len(piece)
    except BaseException:
        sink.abort()
        raise
    sink.commit()


def publish(
    store: Store,
    step: int,
    files: Mapping[str, bytes],
    *,
    generation_id: str | None = None,
    manifest: bytes = MANIFEST,
    signature: bytes | None = None,
) -> GenerationRef:
    area = store.begin_generation(generation_id or new_generation_id())
    try:
        for name, data in files.items():
            write_file(area, name, data)
        return area.publish(step, manifest, signature)
    except BaseException:
        area.abort()
        raise


def entry_table(store: Store, ref: GenerationRef) -> dict[str, tuple[str, int, str | None]]:
    return {key: (e.name, e.size, e.unsafe) for key, e in store.list_entries(ref).items()}


def expected_table(
    files: Mapping[str, bytes], manifest: bytes = MANIFEST, signature: bytes | None = None
) -> dict[str, tuple[str, int, str | None]]:
    everything = {**files, MANIFEST_NAME: manifest}
    if signature is not None:
        everything[SIGNATURE_NAME] = signature
    return {name: (name, len(data), None) for name, data in everything.items()}


def id_at(seconds: int) -> str:
    """A generation id created ``seconds`` after a fixed moment."""
    moment = datetime(2025, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=seconds)
    return new_generation_id(moment)


# -- 1, 2: a store, empty at first ----------------------------------------------------


def test_store_satisfies_the_protocol(backend_store: Store):
    assert isinstance(backend_store, Store)
    assert isinstance(backend_store.location, str) and backend_store.location


def test_store_not_created_yet_lists_nothing(backend_store: Store):
    assert backend_store.list_generations() == []


def test_control_entries_and_staging_areas_are_never_listed(backend_store: Store):
    backend_store.acquire_writer()  # creates the store and its lock
    assert backend_store.list_generations() == []
    area = backend_store.begin_generation(new_generation_id())
    try:
        write_file(area, "a.bin", b"staged")
        assert backend_store.list_generations() == []
    finally:
        area.abort()
    assert backend_store.remove_stale_staging() == []
    assert backend_store.list_generations() == []


# -- 3: publish is all or nothing ---------------------------------------------------


@pytest.mark.parametrize("signature", [None, SIGNATURE], ids=["unsigned", "signed"])
def test_publish_is_all_or_nothing(backend_store: Store, signature: bytes | None):
    files = {"r00000-000.safetensors": payload(4096, 1), "empty.bin": b"", "c.bin": b"c" * 17}
    backend_store.acquire_writer()
    generation_id = new_generation_id()
    area = backend_store.begin_generation(generation_id)
    try:
        assert area.generation_id == generation_id
        for name, data in files.items():
            write_file(area, name, data)
        unfinished = area.create_file("in-progress.bin")
        unfinished.write(b"half of it")
        # Nothing is visible, not to this store object and not to a fresh one.
        assert backend_store.list_generations() == []
        assert open_store(backend_store.location).list_generations() == []
        unfinished.write(b" and the rest")
        unfinished.commit()
        ref = area.publish(7, MANIFEST, signature)
    except BaseException:
        area.abort()
        raise
    assert (ref.step, ref.generation_id) == (7, generation_id)
    assert ref.location.startswith(backend_store.location)
    assert backend_store.list_generations() == [ref]
    assert open_store(backend_store.location).list_generations() == [ref]
    files["in-progress.bin"] = b"half of it and the rest"
    assert entry_table(backend_store, ref) == expected_table(files, MANIFEST, signature)
    assert backend_store.read_bytes(ref, MANIFEST_NAME, MiB) == MANIFEST
    if signature is not None:
        assert backend_store.read_bytes(ref, SIGNATURE_NAME, MiB) == signature


def test_abort_after_publish_keeps_the_generation(backend_store: Store):
    """Callers abort in a ``finally`` or ``except``; a published generation stays."""
    backend_store.acquire_writer()
    area = backend_store.begin_generation(new_generation_id())
    write_file(area, "w.bin", b"weights")
    ref = area.publish(1, MANIFEST)
    area.abort()
    area.abort()
    assert backend_store.list_generations() == [ref]
    assert backend_store.read_bytes(ref, "w.bin", MiB) == b"weights"
    assert backend_store.remove_stale_staging() == []
    assert backend_store.list_generations() == [ref]


def test_location_round_trips_through_open_store(backend_store: Store):
    """The CLI and the manager reopen a store from its location string."""
    backend_store.acquire_writer()
    ref = publish(backend_store, 3, {"w.bin": b"weights"})
    reopened = open_store(backend_store.location, must_exist=True)
    assert isinstance(reopened, Store)
    assert reopened.location == backend_store.location
    assert reopened.list_generations() == [ref]
    assert reopened.read_bytes(ref, "w.bin", MiB) == b"weights"


@pytest.mark.parametrize("signed", [False, True], ids=["unsigned", "signed"])
def test_replace_manifest_swaps_only_the_manifest_and_signature(backend_store: Store, signed: bool):
    """Key rotation's one change to a published generation: compare-and-swap on the
    manifest's exact bytes, signature first, data untouched, nothing left behind."""
    files = {"w.bin": payload(4096, 3)}
    signature = SIGNATURE if signed else None
    new_manifest = MANIFEST[:-1] + b', "rotated": true}'
    new_signature = SIGNATURE + b" (new)" if signed else None
    backend_store.acquire_writer()
    ref = publish(backend_store, 5, files, signature=signature)
    with pytest.raises(IntegrityError, match="changed meanwhile"):
        backend_store.replace_manifest(ref, new_manifest, new_signature, replaces=b"{}")
    if signed:  # a signed generation never keeps a signature over other bytes
        with pytest.raises(UsageError, match="signed"):
            backend_store.replace_manifest(ref, new_manifest, None, replaces=MANIFEST)
    assert entry_table(backend_store, ref) == expected_table(files, MANIFEST, signature)
    backend_store.replace_manifest(ref, new_manifest, new_signature, replaces=MANIFEST)
    reopened = open_store(backend_store.location)
    assert reopened.list_generations() == [ref]
    assert entry_table(reopened, ref) == expected_table(files, new_manifest, new_signature)
    assert reopened.read_bytes(ref, MANIFEST_NAME, MiB) == new_manifest
    assert reopened.read_bytes(ref, "w.bin", MiB) == files["w.bin"]
    if signed:
        assert reopened.read_bytes(ref, SIGNATURE_NAME, MiB) == new_signature
    assert backend_store.remove_stale_staging(older_than=0) == []  # no temporary left
    backend_store.release_writer()
    with pytest.raises(CheckpointError):  # only the writer replaces
        backend_store.replace_manifest(ref, MANIFEST, new_signature, replaces=new_manifest)
    assert reopened.read_bytes(ref, MANIFEST_NAME, MiB) == new_manifest


# -- 4: reads return exactly the bytes written --------------------------------------


def test_reads_return_exactly_the_bytes_written(backend_store: Store):
    small = payload(1000, 2)
    # Larger than the POSIX write-behind window (8 MiB), written in 1 MiB pieces.
    large = payload(9 * MiB + 3, 3)
    backend_store.acquire_writer()
    ref = publish(backend_store, 5, {"small.bin": small, "large.bin": large, "empty.bin": b""})

    for name, data in (("small.bin", small), ("large.bin", large), ("empty.bin", b"")):
        assert backend_store.read_bytes(ref, name, len(data)) == data
        assert backend_store.read_bytes(ref, name, 100 * MiB) == data
        with backend_store.open_file(ref, name) as stream:
            assert stream.readable()
            assert not stream.writable()
            assert stream.readall() == data
            assert stream.read(1) == b""

    read_range = backend_store.read_range
    assert read_range(ref, "small.bin", 0, 1000) == small
    assert read_range(ref, "small.bin", 10, 20) == small[10:30]
    assert read_range(ref, "small.bin", 990, 50) == small[990:]  # runs past the end
    assert read_range(ref, "small.bin", 0, 0) == b""
    assert read_range(ref, "small.bin", 1000, 10) == b""  # starts at the end
    assert read_range(ref, "small.bin", 5000, 10) == b""  # starts past the end
    assert read_range(ref, "empty.bin", 0, 10) == b""
    assert read_range(ref, "large.bin", MiB - 5, 2 * MiB) == large[MiB - 5 : 3 * MiB - 5]
    assert read_range(ref, "large.bin", 9 * MiB, MiB) == large[9 * MiB :]


def test_read_bytes_refuses_a_file_longer_than_the_limit(backend_store: Store):
    backend_store.acquire_writer()
    ref = publish(backend_store, 1, {"w.bin": b"x" * 100})
    assert backend_store.read_bytes(ref, "w.bin", 100) == b"x" * 100
    for limit in (99, 0):
        with pytest.raises(OSError) as raised:
            backend_store.read_bytes(ref, "w.bin", limit)
        assert raised.value.errno == errno.EFBIG


def test_missing_entry_is_an_error_not_empty_bytes(backend_store: Store):
    backend_store.acquire_writer()
    ref = publish(backend_store, 1, {"w.bin": b"weights"})
    with pytest.raises((OSError, CheckpointError)):
        backend_store.open_file(ref, "absent.bin")
    with pytest.raises((OSError, CheckpointError)):
        backend_store.read_bytes(ref, "absent.bin", MiB)
    with pytest.raises((OSError, CheckpointError)):
        backend_store.read_range(ref, "absent.bin", 0, 10)


# -- 5, 6: aborted and crashed saves leave nothing ----------------------------------


def test_aborted_save_leaves_nothing(backend_store: Store):
    backend_store.acquire_writer()
    kept = publish(backend_store, 1, {"w.bin": b"kept"})
    area = backend_store.begin_generation(new_generation_id())
    write_file(area, "a.bin", payload(3000))
    dropped = area.create_file("dropped.bin")
    dropped.write(b"never committed")
    dropped.abort()
    left_open = area.create_file("open.bin")
    left_open.write(b"still open when the save is aborted")
    area.abort()
    left_open.abort()
    area.abort()  # twice is safe
    assert backend_store.list_generations() == [kept]
    assert backend_store.remove_stale_staging() == []
    assert backend_store.list_generations() == [kept]
    assert entry_table(backend_store, kept) == expected_table({"w.bin": b"kept"})
    # The store still takes new saves.
    later = publish(backend_store, 2, {"w.bin": b"later"})
    assert backend_store.list_generations() == [later, kept]


def test_crashed_save_is_never_listed_and_is_removed_under_the_lock(
    backend: Backend, backend_store: Store
):
    backend_store.acquire_writer()
    kept = publish(backend_store, 1, {"w.bin": b"kept"})
    crashed_id = new_generation_id()
    area = backend_store.begin_generation(crashed_id)
    half_written = area.create_file("b.bin")
    try:
        write_file(area, "a.bin", payload(2000))
        half_written.write(b"the process died here")
        # The "crashed" process never publishes nor aborts; its lock dies with it.
        backend_store.release_writer()

        restarted = open_store(backend_store.location)
        assert restarted.list_generations() == [kept]
        assert_cleanup_without_age(backend, restarted)  # not without the writer lock
        restarted.acquire_writer()
        try:
            assert restarted.list_generations() == [kept]
            if backend.cleanup_needs_lock:
                assert restarted.remove_stale_staging() == [crashed_id]
            else:
                assert restarted.remove_stale_staging() == []  # nothing proves it dead
                assert restarted.remove_stale_staging(older_than=0) == [crashed_id]
            assert restarted.remove_stale_staging() == []
            assert restarted.list_generations() == [kept]
            assert entry_table(restarted, kept) == expected_table({"w.bin": b"kept"})
            assert restarted.read_bytes(kept, "w.bin", MiB) == b"kept"
        finally:
            restarted.release_writer()
    finally:
        half_written.abort()
        area.abort()


def test_remove_stale_staging_needs_the_writer_lock(backend: Backend, backend_store: Store):
    assert_cleanup_without_age(backend, backend_store)  # never acquired
    holder = open_store(backend_store.location)
    holder.acquire_writer()
    try:
        assert_cleanup_without_age(backend, backend_store)  # another object holds it
        assert holder.remove_stale_staging() == []
    finally:
        holder.release_writer()
    backend_store.acquire_writer()
    assert backend_store.remove_stale_staging() == []
    backend_store.release_writer()
    assert_cleanup_without_age(backend, backend_store)  # released


# -- 7: listing order ---------------------------------------------------------------


def test_generations_are_listed_newest_first(backend_store: Store):
    backend_store.acquire_writer()
    # (step, seconds after a fixed moment the id was created), published out of order.
    saves = [(5, 20), (10**12, 0), (0, 30), (5, 10), (10, 0), (999, 40), (5, 30)]
    ids = {key: id_at(key[1]) for key in saves}
    refs = {
        key: publish(backend_store, key[0], {"w.bin": b"w"}, generation_id=ids[key])
        for key in saves
    }
    expected_order = [(10**12, 0), (999, 40), (10, 0), (5, 30), (5, 20), (5, 10), (0, 30)]
    listed = backend_store.list_generations()
    assert [(r.step, r.generation_id) for r in listed] == [(k[0], ids[k]) for k in expected_order]
    assert listed == [refs[key] for key in expected_order]


# -- 8: published generations stay as published -------------------------------------


def test_published_generation_cannot_be_replaced_by_reusing_its_id(backend_store: Store):
    backend_store.acquire_writer()
    original = {"w.bin": b"original weights", "o.bin": b"other"}
    generation_id = new_generation_id()
    ref = publish(backend_store, 7, original, generation_id=generation_id, signature=SIGNATURE)

    area: StagingArea | None = None
    with pytest.raises((CheckpointError, OSError)):
        area = backend_store.begin_generation(generation_id)
        write_file(area, "w.bin", b"replacement weights!")
        write_file(area, "extra.bin", b"smuggled in")
        area.publish(7, b'{"replaced": true}', b"another signature")
    if area is not None:
        area.abort()

    assert backend_store.list_generations() == [ref]
    assert entry_table(backend_store, ref) == expected_table(original, MANIFEST, SIGNATURE)
    assert backend_store.read_bytes(ref, "w.bin", MiB) == b"original weights"
    assert backend_store.read_bytes(ref, MANIFEST_NAME, MiB) == MANIFEST
    assert backend_store.read_bytes(ref, SIGNATURE_NAME, MiB) == SIGNATURE
    assert backend_store.remove_stale_staging() == []


@pytest.mark.parametrize("late", ["create_file", "publish"])
@pytest.mark.parametrize("finish", ["published", "aborted"])
def test_finished_staging_area_writes_nowhere(
    backend: Backend, tmp_path: Path, finish: str, late: str
):
    """A staging area that was published or aborted takes no more files and cannot
    be published (again): nothing lands in its store or in any other store."""
    first = _another_store(backend, tmp_path, "first")
    second = _another_store(backend, tmp_path, "second")
    first.acquire_writer()
    second.acquire_writer()
    try:
        done = first.begin_generation(new_generation_id())
        write_file(done, "w.bin", b"weights")
        if finish == "published":
            published = done.publish(1, MANIFEST)
        else:
            done.abort()

        other = second.begin_generation(new_generation_id())
        try:
            write_file(other, "x.bin", b"second store")
            with pytest.raises((CheckpointError, OSError)):
                if late == "create_file":
                    write_file(done, "late.bin", b"written after the area was finished")
                else:
                    done.publish(9, b'{"late": true}')
            other_ref = other.publish(2, MANIFEST)
        except BaseException:
            other.abort()
            raise
        assert second.list_generations() == [other_ref]
        assert entry_table(second, other_ref) == expected_table({"x.bin": b"second store"})
        assert second.read_bytes(other_ref, MANIFEST_NAME, MiB) == MANIFEST
        if finish == "published":
            assert first.list_generations() == [published]
            assert entry_table(first, published) == expected_table({"w.bin": b"weights"})
        else:
            assert first.list_generations() == []
        assert first.remove_stale_staging() == []
        assert second.remove_stale_staging() == []
    finally:
        first.release_writer()
        second.release_writer()


def test_the_beginning_rank_reads_back_what_a_joined_rank_committed(backend_store: Store):
    """A collective save's rank 0 reads back the index another rank wrote into the
    attempt (``read_staged``), never more than the limit it gives, and publishes it."""
    backend_store.acquire_writer()
    generation_id = new_generation_id()
    area = backend_store.begin_generation(generation_id)
    joined = backend_store.join_generation(generation_id)
    try:
        index = payload(3000, seed=7)
        write_file(joined, "r00001-index.json", index)
        joined.release()
        area.adopt(["r00001-index.json"])
        assert area.read_staged("r00001-index.json", len(index)) == index
        with pytest.raises(OSError) as raised:
            area.read_staged("r00001-index.json", len(index) - 1)
        assert raised.value.errno == errno.EFBIG
        ref = area.publish(1, MANIFEST)
    except BaseException:
        area.abort()
        raise
    assert backend_store.read_bytes(ref, "r00001-index.json", MiB) == index


# -- 9: the single-writer lock ------------------------------------------------------


def test_writer_lock_is_idempotent_and_exclusive_within_a_process(backend_store: Store):
    backend_store.release_writer()  # releasing what is not held is harmless
    backend_store.acquire_writer()
    backend_store.acquire_writer()  # idempotent for the same store object
    other = open_store(backend_store.location)
    with pytest.raises(StoreLockedError) as raised:
        other.acquire_writer()  # a second store object is a second writer
    assert backend_store.location in str(raised.value)
    # Readers never need the lock.
    assert other.list_generations() == []
    backend_store.release_writer()  # one release undoes any number of acquires
    other.acquire_writer()
    try:
        with pytest.raises(StoreLockedError):
            backend_store.acquire_writer()
    finally:
        other.release_writer()
    backend_store.acquire_writer()


_LOCK_HOLDER = textwrap.dedent(
    """
    import sys
    from ckptvault.errors import StoreLockedError
    from ckptvault.storage import open_store

    store = open_store(sys.argv[1])
    try:
        store.acquire_writer()
    except StoreLockedError:
        print("locked", flush=True)
        sys.exit(0)
    print("held", flush=True)
    for line in sys.stdin:
        if line.strip() == "release":
            store.release_writer()
            print("released", flush=True)
    """
)


def _lock_holder(location: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _LOCK_HOLDER, location],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )


@pytest.mark.timeout(120)
def test_writer_lock_excludes_another_process(backend: Backend, backend_store: Store):
    holder = _lock_holder(backend_store.location)
    try:
        assert holder.stdout is not None and holder.stdin is not None
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreLockedError) as raised:
            backend_store.acquire_writer()
        assert backend_store.location in str(raised.value)
        assert_cleanup_without_age(backend, backend_store)
        assert backend_store.list_generations() == []  # reading is never blocked

        holder.stdin.write("release\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "released"
        backend_store.acquire_writer()
    finally:
        holder.kill()
        holder.wait()
    refused = subprocess.run(
        [sys.executable, "-c", _LOCK_HOLDER, backend_store.location],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert refused.stdout.strip() == "locked", refused.stderr


@pytest.mark.timeout(120)
def test_writer_lock_of_a_killed_process_is_released(backend_store: Store):
    holder = _lock_holder(backend_store.location)
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(StoreLockedError):
            backend_store.acquire_writer()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    backend_store.acquire_writer()  # no stale lock left behind
    ref = publish(backend_store, 1, {"w.bin": b"w"})
    assert backend_store.list_generations() == [ref]


# -- 10: the store is hostile ground ------------------------------------------------


@pytest.mark.timeout(20)  # a reader that blocks on the FIFO would hang here
@pytest.mark.parametrize(
    "kind", ["symlink", "fifo", "hardlink", "directory", "duplicate", "misplaced"]
)
def test_planted_entry_is_reported_unsafe_and_never_opened(
    backend: Backend, backend_store: Store, kind: str
):
    plant = backend.entry_saboteurs.get(kind)
    if plant is None:
        pytest.skip(f"this backend cannot hold a {kind}")
    backend_store.acquire_writer()
    ref = publish(backend_store, 3, {"w.bin": b"weights"})
    untouched = plant(backend_store, ref, "planted.bin")

    entries = backend_store.list_entries(ref)
    assert set(entries) == {"w.bin", MANIFEST_NAME, "planted.bin"}
    reason = entries["planted.bin"].unsafe
    assert isinstance(reason, str) and reason.strip()
    assert entries["w.bin"] == EntryInfo("w.bin", len(b"weights"), None)
    assert entries[MANIFEST_NAME] == EntryInfo(MANIFEST_NAME, len(MANIFEST), None)

    with pytest.raises(UnsafeEntryError):
        backend_store.open_file(ref, "planted.bin")
    with pytest.raises(UnsafeEntryError):
        backend_store.read_bytes(ref, "planted.bin", MiB)
    with pytest.raises(UnsafeEntryError):
        backend_store.read_range(ref, "planted.bin", 0, 16)
    # The rest of the generation is still served.
    assert backend_store.read_bytes(ref, "w.bin", MiB) == b"weights"
    assert backend_store.list_generations() == [ref]
    untouched()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["symlink", "file"])
def test_generation_that_is_not_a_generation_is_refused(
    backend: Backend, backend_store: Store, kind: str
):
    plant = backend.generation_saboteurs.get(kind)
    if plant is None:
        pytest.skip(f"this backend cannot replace a generation by a {kind}")
    backend_store.acquire_writer()
    ref = publish(backend_store, 3, {"w.bin": b"weights"})
    untouched = plant(backend_store, ref)

    with pytest.raises(UnsafeEntryError):
        backend_store.list_entries(ref)
    with pytest.raises(UnsafeEntryError):
        backend_store.open_file(ref, "w.bin")
    with pytest.raises(UnsafeEntryError):
        backend_store.read_bytes(ref, MANIFEST_NAME, MiB)
    with pytest.raises(UnsafeEntryError):
        backend_store.read_range(ref, "w.bin", 0, 4)
    # Cleanup and new saves neither follow nor delete it.
    assert backend_store.remove_stale_staging() == []
    later = publish(backend_store, 4, {"w.bin": b"later"})
    assert backend_store.read_bytes(later, "w.bin", MiB) == b"later"
    untouched()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("kind", ["staging_symlink", "lock_symlink", "lock_garbage"])
def test_control_entries_are_never_followed_out_of_the_store(
    backend: Backend, backend_store: Store, kind: str
):
    plant = backend.store_saboteurs.get(kind)
    if plant is None:
        pytest.skip(f"this backend has no {kind} to plant")
    untouched = plant(backend_store)
    try:
        backend_store.acquire_writer()
    except UnsafeEntryError:
        # Refusing to lock through a planted link is fine; writing through it is not.
        assert backend_store.list_generations() == []
        untouched()
        return
    assert backend_store.remove_stale_staging() == []
    untouched()
    aborted = backend_store.begin_generation(new_generation_id())
    write_file(aborted, "a.bin", b"aborted")
    aborted.abort()
    ref = publish(backend_store, 1, {"w.bin": b"weights"})
    assert backend_store.list_generations() == [ref]
    assert backend_store.read_bytes(ref, "w.bin", MiB) == b"weights"
    untouched()


@pytest.mark.timeout(20)
def test_cleanup_never_follows_links_out_of_the_store(backend: Backend, backend_store: Store):
    plant = backend.store_saboteurs.get("stale_staging_links")
    if plant is None:
        pytest.skip("this backend has no links to plant")
    untouched = plant(backend_store)
    backend_store.acquire_writer()
    removed = backend_store.remove_stale_staging()
    assert len(removed) == 2
    assert backend_store.remove_stale_staging() == []  # the links themselves are gone
    assert backend_store.list_generations() == []
    untouched()


# -- 11: holds_path -----------------------------------------------------------------


def test_holds_path(
    backend: Backend, backend_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    elsewhere = tmp_path / "control-plane" / "keys"
    assert not backend_store.holds_path(elsewhere)
    assert not backend_store.holds_path(tmp_path)
    if backend.local_root is None:
        return  # a store that keeps no local files holds no local path
    root = backend.local_root(backend_store)
    assert backend_store.holds_path(root)
    assert backend_store.holds_path(root / "keys" / "run.key")  # need not exist yet
    assert not backend_store.holds_path(root.parent)
    assert not backend_store.holds_path(root.parent / (root.name + "-keys"))  # a prefix only
    backend_store.acquire_writer()  # creates the store
    # A link from elsewhere into the store still points inside it.
    link = tmp_path / "link-into-store"
    link.symlink_to(root, target_is_directory=True)
    assert backend_store.holds_path(link / "keys")
    # Relative paths are taken from the working directory.
    monkeypatch.chdir(root.parent)
    assert backend_store.holds_path(Path(root.name) / "keys")
    assert not backend_store.holds_path(Path("control-plane"))


# -- 12: open_store on local locations ----------------------------------------------


@pytest.mark.parametrize(
    "form", ["str", "path", "relative", "file-url", "file-localhost-url", "file-url-quoted"]
)
def test_open_store_accepts_local_locations(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str
):
    root = tmp_path / "my store"
    reference = PosixStore(root)
    reference.acquire_writer()
    ref = publish(reference, 2, {"w.bin": b"weights"})
    reference.release_writer()
    monkeypatch.chdir(tmp_path)
    locations: dict[str, str | Path] = {
        "str": str(root),
        "path": root,
        "relative": "my store",
        "file-url": f"file://{root}",
        "file-localhost-url": f"file://localhost{root}",
        "file-url-quoted": f"file://{str(root).replace(' ', '%20')}",
    }
    opened = open_store(locations[form], must_exist=True)
    assert isinstance(opened, Store)
    assert opened.location == str(root)
    assert opened.list_generations() == [ref]
    assert opened.read_bytes(ref, "w.bin", MiB) == b"weights"


def test_open_store_returns_a_store_object_unchanged(backend_store: Store):
    assert open_store(backend_store) is backend_store


@pytest.mark.parametrize(
    "location", ["nosuchscheme://bucket/prefix", "ftp://host/store", "file://otherhost/store"]
)
def test_open_store_rejects_unknown_locations(location: str):
    with pytest.raises(UsageError):
        open_store(location)


def test_open_store_must_exist(tmp_path: Path):
    missing = tmp_path / "missing"
    with pytest.raises(UsageError):
        open_store(missing, must_exist=True)
    with pytest.raises(UsageError):
        open_store(f"file://{missing}", must_exist=True)
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"not a store")
    with pytest.raises(UsageError):
        open_store(a_file, must_exist=True)
    # Without must_exist a missing store is an empty one, and reading creates nothing.
    assert open_store(missing).list_generations() == []
    assert not missing.exists()
    missing.mkdir()
    assert open_store(missing, must_exist=True).list_generations() == []
