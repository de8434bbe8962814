"""Where drills run: a scratch copy of a store, and how to open managers on it.

Drills never touch the live store. :func:`context_from_store` opens it only to read
(list generations, open plain files through the store's own checked reads) and
copies the newest published generations, file by file, into a temporary local
store; an ``s3://`` store is copied the same way into a local one. A local key store
is copied too, so the key-destroyed drill erases a copy. :func:`synthetic_context`
builds a small signed, encrypted run of its own instead. Each drill then takes a
fresh copy of that base (:meth:`DrillContext.fresh_copy`) and its own ledger, audit
log and key store, all inside the scratch directory: a drill's floor or erased key
never reaches the user's control-plane state.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckptvault.errors import CheckpointError, FormatError, StorageFullError, UsageError
from ckptvault.format.layout import MANIFEST_NAME
from ckptvault.format.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from ckptvault.storage import S3Options, open_store
from ckptvault.storage.base import GenerationRef, Store

Progress = Callable[[str], None]  # told what is being prepared, for a progress display
COPY_BLOCK = 4 << 20
SCRATCH_COPIES = 8  # the base copy, and one for each drill that damages a copy of it
SCRATCH_HEADROOM = 64 << 20


@dataclass
class DrillContext:
    """A scratch directory holding a base copy of a run and how to open it.

    ``synthetic``: the run is :mod:`ckptvault.ops.drills.synthetic`'s, so restores go
    into freshly built live objects (strictly); otherwise the drill has no model and
    restores into an empty mapping with ``strict=False`` (every byte is still
    verified and read; nothing is applied).
    """

    scratch: Path
    base: Path  # the copied generations; drills copy it again, never change it
    run_id: str
    synthetic: bool
    source: str  # what was copied, for the report
    keystore: Path | None = None  # a copy of the run's local key store
    signing_key: Path | None = None
    trusted_key: Path | None = None
    bytes_per_generation: int = 0

    def workdir(self, label: str) -> Path:
        """A new directory of the scratch space for one drill's files."""
        path = self.scratch / label
        path.mkdir(parents=True, exist_ok=True)
        return path

    def fresh_copy(self, label: str) -> Path:
        """A private copy of the base store for a drill to damage."""
        target = self.workdir(label) / "store"
        shutil.copytree(self.base, target, symlinks=True)
        return target

    def generations(self, store: Path) -> list[GenerationRef]:
        """The published generations of a local store, newest first."""
        return open_store(store).list_generations()

    def manager_options(self, label: str, **extra: Any) -> dict[str, Any]:
        """Options for a manager of this run whose control-plane state (ledger,
        audit log) lives in the drill's own scratch directory."""
        work = self.workdir(label)
        options: dict[str, Any] = {
            "run_id": self.run_id,
            "ledger": work / "ledger.sqlite3",
            "audit_log": work / "audit.log",
            "catalog": False,
            "threads": 2,
        }
        if self.keystore is not None:
            options["keystore"] = self.keystore
        if self.signing_key is not None:
            options["signing_key"] = self.signing_key
        if self.trusted_key is not None:
            options["trusted_keys"] = [self.trusted_key]
        options.update(extra)
        return options

    def manager(self, store: Path | Store, label: str, **extra: Any) -> Any:
        """A :class:`~ckptvault.CheckpointManager` on ``store`` (see :meth:`manager_options`)."""
        from ckptvault.manager import CheckpointManager

        # open_store takes a store object as it is (the slow-storage drill's wrapper).
        location: Any = store
        return CheckpointManager(location, **self.manager_options(label, **extra))

    def new_state(self) -> tuple[dict[str, Any], bool]:
        """Live objects to restore into, and whether to restore strictly."""
        if self.synthetic:
            from ckptvault.ops.drills.synthetic import build_state

            return build_state(seed=1), True
        return {}, False

    def state_to_save(self) -> dict[str, Any]:
        """A state a drill can save into this run (the run's layout when synthetic)."""
        from ckptvault.ops.drills.synthetic import ballast_state, build_state

        if self.synthetic:
            return build_state(seed=2)
        return ballast_state(min(max(self.bytes_per_generation, 1 << 20), 64 << 20))


def context_from_store(
    location: str,
    scratch: Path,
    keystore: str | None = None,
    generations: int = 3,
    s3_endpoint_url: str | None = None,
    progress: Progress | None = None,
) -> DrillContext:
    """Copy the newest ``generations`` published generations of ``location`` (read
    only) into ``scratch`` and describe the run they belong to."""
    if generations < 1:
        raise UsageError(f"--generations must be at least 1, not {generations}")
    s3 = S3Options.from_keywords(endpoint_url=s3_endpoint_url)
    source = open_store(location, must_exist=True, s3=s3)
    refs = source.list_generations()[:generations]
    if not refs:
        raise UsageError(f"store {source.location} holds no generations to drill")
    manifest = _newest_manifest(source, refs)
    base = scratch / "base"
    base.mkdir(parents=True)
    listed = [(ref, plain_entries(source, ref)) for ref in refs]
    check_scratch_room(scratch, listed)
    copied = 0
    for ref, entries in listed:
        if progress is not None:
            progress(f"copying step {ref.step}")
        copied = max(copied, copy_generation(source, ref, base, entries))
    copy_keys = None
    if manifest.encryption is not None:
        copy_keys = _copy_keystore(keystore, source.location, scratch / "keys")
    return DrillContext(
        scratch=scratch,
        base=base,
        run_id=manifest.run_id,
        synthetic=False,
        source=source.location,
        keystore=copy_keys,
        bytes_per_generation=copied,
    )


def plain_entries(source: Store, ref: GenerationRef) -> dict[str, int]:
    """The plain files of a generation and their listed sizes; entries the store
    reports unsafe (links, special files) are left out."""
    return {
        name: entry.size
        for name, entry in sorted(source.list_entries(ref).items())
        if entry.unsafe is None
    }


def check_scratch_room(scratch: Path, listed: list[tuple[GenerationRef, dict[str, int]]]) -> None:
    """Refuse, before copying anything, when the scratch directory cannot hold the base
    copy and one copy per drill (:data:`SCRATCH_COPIES`).

    The store's writer chooses its files: a sparse file listed at a terabyte, or a
    million empty ones, must not fill the disk the drill runs on.
    """
    nbytes = sum(size for _ref, entries in listed for size in entries.values())
    nfiles = sum(len(entries) + 1 for _ref, entries in listed)
    info = os.statvfs(scratch)
    free, inodes = info.f_bavail * info.f_frsize, info.f_favail
    need = SCRATCH_COPIES * nbytes + SCRATCH_HEADROOM
    if need > free or (info.f_files and SCRATCH_COPIES * nfiles > inodes):
        biggest = max(listed, key=lambda pair: sum(pair[1].values()))
        raise StorageFullError(
            f"drilling {len(listed)} generation(s) needs {need} bytes and "
            f"{SCRATCH_COPIES * nfiles} files in {scratch} ({SCRATCH_COPIES} copies of "
            f"{nbytes} bytes in {nfiles} files), but it has {free} bytes and {inodes} files "
            f"free; the largest, {biggest[0].location}, lists {sum(biggest[1].values())} bytes "
            f"in {len(biggest[1])} files. Drill fewer generations (--generations), point TMPDIR "
            "at a larger filesystem, or check the store for planted files (ckptvault verify)"
        )


def copy_generation(
    source: Store, ref: GenerationRef, target_root: Path, entries: dict[str, int] | None = None
) -> int:
    """Copy one generation's plain files (``entries``: name -> listed size; default: the
    store's listing) into ``target_root`` (a local store); each file is copied up to
    its listed size, so a file that grows after the listing cannot fill the disk.
    Returns the bytes copied."""
    if entries is None:
        entries = plain_entries(source, ref)
    target = target_root / ref.name.dirname
    target.mkdir()
    copied = 0
    for name, size in entries.items():
        with source.open_file(ref, name) as stream, open(target / name, "xb") as out:
            left = size
            while left > 0 and (block := stream.read(min(COPY_BLOCK, left))):
                out.write(block)
                left -= len(block)
            copied += size - left
            out.flush()
            os.fsync(out.fileno())
    return copied


def _newest_manifest(source: Store, refs: list[GenerationRef]) -> Manifest:
    """The manifest of the newest generation whose manifest parses (run id, encryption)."""
    problems = []
    for ref in refs:
        where = f"generation {ref.generation_id} (step {ref.step})"
        try:
            return parse_manifest(source.read_bytes(ref, MANIFEST_NAME, MAX_MANIFEST_BYTES), where)
        except (OSError, CheckpointError) as exc:
            problems.append(f"{where}: {exc}")
    raise FormatError(
        f"no manifest among the newest generations of {source.location} parses, so the run "
        "cannot be identified: " + "; ".join(problems)
    )


def _copy_keystore(keystore: str | None, store: str, target: Path) -> Path:
    """A copy of a local key store: the key-destroyed drill erases the copy, never
    the key the live run depends on."""
    if keystore is None:
        raise UsageError(
            f"{store} is encrypted: give its key store with --keystore DIR (a copy is used)"
        )
    if "://" in keystore:
        raise UsageError(
            f"--keystore {keystore}: drills copy the key store so that erasing a key cannot "
            "touch the live one, and a KMS key cannot be copied; drill a local key store, "
            "or run `ckptvault drill --synthetic`"
        )
    shutil.copytree(keystore, target, symlinks=False)
    return target


def synthetic_context(scratch: Path, steps: tuple[int, ...] = (10, 20, 30)) -> DrillContext:
    """A small run of its own: signed (a fresh key pair), encrypted (a fresh local
    key store), one generation per entry of ``steps``."""
    from ckptvault.manager import CheckpointManager
    from ckptvault.ops.drills.synthetic import build_state, train_step
    from ckptvault.trust.signing import generate_keypair

    keys = scratch / "signing"
    generate_keypair(keys / "drill.pem", keys / "drill.pub")
    context = DrillContext(
        scratch=scratch,
        base=scratch / "base",
        run_id="drill-synthetic",
        synthetic=True,
        source="synthetic run",
        keystore=scratch / "keys",
        signing_key=keys / "drill.pem",
        trusted_key=keys / "drill.pub",
    )
    state = build_state(seed=0)
    options = context.manager_options("synthetic-build")
    with CheckpointManager(context.base, **options) as manager:
        for step in steps:
            train_step(state)
            state["meta"]["step"] = step
            info = manager.save(step, state).result()
            context.bytes_per_generation = info.bytes if info is not None else 0
    return context
