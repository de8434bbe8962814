"""The memory tier of a job on several nodes.

Each node has its own memory directory (:class:`NodeMemoryStore`, a POSIX store).
A save into memory runs as any collective save, with two steps added:

- before the coordinator publishes, every rank on another node ships the files it
  wrote to rank 0 (:meth:`NodeMemoryStore.ship_to_coordinator`), so the
  coordinator's node publishes the whole generation, as on one node;
- after it, the coordinator copies the published generation to the first rank of
  ``peers`` other nodes, each of which publishes it in its own directory
  (:func:`copy_to_peers`): a generation lives in memory on ``1 + peers`` nodes.

Before a restore, the nodes' first ranks exchange what their directories hold (JSON
over the coordinator) and a node missing a generation another holds fetches it from
there (:func:`complete_locally`): then every node restores from its own directory,
and a generation fetched from a peer is reported as ``source == "peer"``.

A node never publishes a copy it has not verified: it receives into a private
directory below its ``.staging``, publishes there, checks the whole generation as
restore would (:func:`~ckptvault.trust.checks.verify_generation` with the run's
policy: signature, run, file set, every digest, the run's key), and only then
renames it into its memory directory. A copy that does not fit in the node's
memory is refused before any byte crosses; what a node offers is only the plain
files of its newest :data:`MAX_HELD` generations.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from pathlib import Path
from typing import IO, Any

from ckptvault.distributed import messages
from ckptvault.errors import (
    CheckpointError,
    IntegrityError,
    PeerMessageError,
    SaveFailedError,
    UnsafeEntryError,
)
from ckptvault.format.layout import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    STAGING_DIR,
    GenerationName,
    is_generation_id,
    parse_generation_dirname,
)
from ckptvault.format.manifest import MAX_MANIFEST_BYTES
from ckptvault.memory.transfer import Transfer, file_sizes, run_transfers
from ckptvault.storage.base import GenerationRef
from ckptvault.storage.posix.files import open_dir, opened, remove_tree
from ckptvault.storage.posix.publish import PosixStagingArea
from ckptvault.storage.posix.store import PosixStore
from ckptvault.trust.checks import MAX_SIGNATURE_BYTES, TrustPolicy, verify_generation

logger = logging.getLogger("ckptvault")

MAX_FILES = 100_000  # per generation, in what a node says it holds
MAX_HELD = 64  # generations a node says it holds: its newest
MAX_NAME = 255
METADATA = {MANIFEST_NAME: MAX_MANIFEST_BYTES, SIGNATURE_NAME: MAX_SIGNATURE_BYTES}
INCOMING = "peer-"  # below .staging: a copy being received, verified before it is moved


class NodeMemoryStore(PosixStore):
    """One node's memory directory in a job on several nodes. ``nodes``: every
    rank's node, by rank (rank 0's is the coordinator's)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        nodes: list[str],
        coordinator: Any,
        policy: TrustPolicy | None = None,
    ) -> None:
        super().__init__(root)
        self.nodes, self.coordinator = nodes, coordinator
        self.node = nodes[coordinator.rank]
        self.policy = policy  # what a copy from a peer must pass before it is published

    def leaders(self) -> dict[str, int]:
        """Each node's first rank."""
        first: dict[str, int] = {}
        for rank, node in enumerate(self.nodes):
            first.setdefault(node, rank)
        return first

    def join_generation(self, generation_id: str) -> PosixStagingArea:
        """The attempt's staging area on this node: created here when rank 0's is on
        another node (where its files go before the publish)."""
        if is_generation_id(generation_id) and self.node != self.nodes[0]:
            fd = self.open_staging_dir()
            try:
                os.mkdir(generation_id, 0o755, dir_fd=fd)
            except FileExistsError:
                pass
            finally:
                os.close(fd)
        return super().join_generation(generation_id)

    def ship_to_coordinator(self, area: Any, own_files: list[str]) -> None:
        """Collective: every rank on another node than rank 0 sends the files it wrote
        into ``area`` to rank 0, which writes them into its own; each rank raises the
        same error when any failed."""
        coordinator = self.coordinator
        remote = self.node != self.nodes[0]
        error = None
        try:
            mine = file_sizes(area.location, own_files) if remote else {}
        except (OSError, PeerMessageError) as exc:
            mine, error = {}, f"{type(exc).__name__}: {exc}"
        gathered = coordinator.all_gather({"files": mine, "error": error})
        try:
            plan = [
                Transfer(rank, 0, name, size)
                for rank, entry in enumerate(gathered)
                for name, size in sorted(_file_list(entry, rank).items())
            ]
            failed = [entry.get("error") for entry in gathered if entry.get("error")]
            if failed:
                raise SaveFailedError(f"a rank could not list its files: {failed[0]}")
        except PeerMessageError as exc:
            raise SaveFailedError(f"{exc}. Nothing was published") from exc
        try:
            run_transfers(
                plan,
                coordinator.rank,
                coordinator.process_group,
                lambda name: _open_plain(Path(area.location) / name),
                area.create_file,
            )
            error = None
        except (OSError, RuntimeError, CheckpointError) as exc:
            error = f"{type(exc).__name__}: {str(exc)[:2000]}"
        outcomes = coordinator.all_gather(error)
        failed = [
            f"rank {r}: {e}"
            for r, raw in enumerate(outcomes)
            if (e := messages.outcome(raw, r, "shipping files"))
        ]
        if failed:
            raise SaveFailedError(
                f"shipping files to rank 0's node failed ({'; '.join(failed)[:2000]}). "
                "Nothing was published"
            )
        if remote:
            area.abort()  # rank 0 holds them now: this node keeps no partial copy
            with contextlib.suppress(OSError):
                fd = self.open_staging_dir()
                try:
                    os.rmdir(area.generation_id, dir_fd=fd)
                finally:
                    os.close(fd)


def copy_to_peers(
    store: NodeMemoryStore, ref_name: str | None, peers: int
) -> tuple[list[str], GenerationName | None]:
    """Collective, after rank 0 published ``ref_name`` (its directory name, known on
    rank 0 only) in its node's directory: the first rank of ``peers`` other nodes
    receives a copy and publishes it. Returns the errors (a failed copy leaves fewer
    copies; it never fails the save) and the generation's name."""
    coordinator = store.coordinator
    leaders = store.leaders()
    others = [node for node in sorted(leaders) if node != store.nodes[0]][:peers]
    offer: dict[str, Any] = {}
    if coordinator.is_coordinator and ref_name is not None:
        offer = {"dirname": ref_name, "files": _entries(store, ref_name)}
    offer = coordinator.broadcast(offer)
    if not offer or not others:
        return [], None
    targets = [leaders[node] for node in others]
    return _send_generation(store, offer, 0, targets), parse_generation_dirname(
        str(offer.get("dirname"))
    )


def complete_locally(store: NodeMemoryStore) -> set[str]:
    """Collective, before a restore: each node fetches the generations other nodes'
    directories hold and its own lacks. Returns the generation ids this node
    fetched (from a peer)."""
    coordinator = store.coordinator
    leaders = store.leaders()
    leading = leaders[store.node] == coordinator.rank
    held: dict[str, Any] = {}
    if leading:
        try:
            held = {
                ref.name.dirname: _entries(store, ref.name.dirname)
                for ref in store.list_generations()[:MAX_HELD]  # newest first
            }
        except (OSError, CheckpointError) as exc:
            logger.warning("listing the memory tier %s failed: %s", store.location, exc)
    gathered = coordinator.all_gather(held)
    holders: dict[str, int] = {}
    offers: dict[str, dict[str, int]] = {}
    for rank, entry in enumerate(gathered):
        for dirname, files in _held(entry, rank).items():
            holders.setdefault(dirname, rank)
            offers.setdefault(dirname, files)
    fetched: set[str] = set()
    for dirname in sorted(offers):
        source = holders[dirname]
        lacking = [
            leaders[node]
            for node in sorted(leaders)
            if dirname not in _held(gathered[leaders[node]], leaders[node])
        ]
        if not lacking:
            continue
        errors = _send_generation(
            store, {"dirname": dirname, "files": offers[dirname]}, source, lacking
        )
        if leaders[store.node] in lacking and not errors:  # this node fetched it
            name = parse_generation_dirname(dirname)
            if name is not None:
                fetched.add(name.generation_id)
    return fetched


def _send_generation(
    store: NodeMemoryStore, offer: dict[str, Any], source: int, targets: list[int]
) -> list[str]:
    """``source`` sends the generation ``offer`` names to every rank of ``targets``,
    each of which verifies it and publishes it in its node's directory; every rank
    learns the errors. An offer every rank refuses alike costs no collective."""
    coordinator = store.coordinator
    dirname = str(offer.get("dirname"))[:MAX_NAME]
    name = parse_generation_dirname(dirname)
    try:
        if name is None:
            raise PeerMessageError(f"rank {source} offered {dirname!r}, not a generation")
        files = _file_list(offer, source)
        for metadata, limit in METADATA.items():
            if files.get(metadata, 0) > limit:
                raise PeerMessageError(f"rank {source} gave {metadata} a size over {limit}")
        if MANIFEST_NAME not in files:
            raise PeerMessageError(f"rank {source} offered {dirname} without {MANIFEST_NAME}")
    except PeerMessageError as exc:
        return [f"{exc}; no rank received it"]
    assert name is not None
    # Each target first makes room for the copy (or says why not): only those that
    # did take part in the transfers.
    incoming: _Incoming | None = None
    error = None
    if coordinator.rank in targets:
        try:
            store.check_capacity(sum(files.values()), len(files))
            incoming = _Incoming(store, name)
        except (OSError, CheckpointError) as exc:
            error = f"{type(exc).__name__}: {str(exc)[:2000]}"
    ready = coordinator.all_gather(error)
    refused = {r: e for r, raw in enumerate(ready) if (e := messages.outcome(raw, r, "a copy"))}
    plan = [
        Transfer(source, target, file, size)
        for target in targets
        if target not in refused
        for file, size in sorted(files.items())
    ]
    ref = GenerationRef(name, str(Path(store.location) / dirname))
    error = None
    try:
        run_transfers(
            plan,
            coordinator.rank,
            coordinator.process_group,
            lambda file: store.open_file(ref, file),
            lambda file: incoming.sink(file) if incoming is not None else None,
        )
        if incoming is not None:
            incoming.publish(source)
    except (OSError, RuntimeError, CheckpointError) as exc:
        error = f"{type(exc).__name__}: {str(exc)[:2000]}"
    finally:
        if incoming is not None:
            incoming.close()
    outcomes = coordinator.all_gather(error)
    failed = {r: e for r, raw in enumerate(outcomes) if (e := messages.outcome(raw, r, "a copy"))}
    return [f"rank {rank}: {message}" for rank, message in sorted({**refused, **failed}.items())]


class _Incoming:
    """A copy from a peer, received into ``.staging/peer-<id>/`` (a store of its own),
    published there, verified as restore would, then renamed into the node's
    directory; removed whatever happens."""

    def __init__(self, store: NodeMemoryStore, name: GenerationName) -> None:
        self.store, self.name = store, name
        self.dirname = INCOMING + name.generation_id
        self.metadata: dict[str, bytearray] = {}
        with opened(store.open_staging_dir()) as staging_fd:
            remove_tree(staging_fd, self.dirname)  # a leftover of a crash
            os.mkdir(self.dirname, 0o700, dir_fd=staging_fd)
        self.scratch = PosixStore(Path(store.location, STAGING_DIR, self.dirname))
        self.area: PosixStagingArea | None = None
        try:
            self.area = self.scratch.begin_generation(name.generation_id)
        except BaseException:
            self.close()
            raise

    def sink(self, file: str) -> Any:
        if file in METADATA:
            return _Buffer(self.metadata.setdefault(file, bytearray()))
        assert self.area is not None
        return self.area.create_file(file)

    def publish(self, source: int) -> None:
        """Verified, then visible in the node's directory; IntegrityError otherwise."""
        assert self.area is not None
        signature = self.metadata.get(SIGNATURE_NAME)
        area, self.area = self.area, None
        ref = area.publish(
            self.name.step,
            bytes(self.metadata.get(MANIFEST_NAME, b"")),
            bytes(signature) if signature is not None else None,
        )
        report = verify_generation(self.scratch, ref, self.store.policy)
        if not report.ok:
            problems = "; ".join(f"{p.code}: {p.detail}" for p in report.problems[:3])
            raise IntegrityError(
                f"the copy of {self.name.dirname} received from rank {source} does not "
                f"verify ({problems[:1500]}); it was not published in {self.store.location}. "
                "The node keeps the copies it has; restore checks every copy anyway"
            )
        dirname = self.name.dirname
        with (
            opened(self.scratch.open_root()) as scratch_fd,
            opened(self.store.open_root()) as root_fd,
        ):
            try:
                os.close(open_dir(dirname, root_fd, f"{self.store.location}/{dirname}"))
            except FileNotFoundError:
                pass
            else:
                raise IntegrityError(
                    f"{self.store.location}/{dirname} already exists; the copy from rank "
                    f"{source} was not published over it"
                )
            os.rename(dirname, dirname, src_dir_fd=scratch_fd, dst_dir_fd=root_fd)
            os.fsync(root_fd)

    def close(self) -> None:
        if self.area is not None:
            self.area.abort()
            self.area = None
        with contextlib.suppress(OSError), opened(self.store.open_staging_dir()) as staging_fd:
            remove_tree(staging_fd, self.dirname)


def _entries(store: NodeMemoryStore, dirname: str) -> dict[str, int]:
    """The plain files of a published generation of ``store``, with their sizes (a
    link, a FIFO or a directory planted there is never offered)."""
    name = parse_generation_dirname(dirname)
    if name is None:
        return {}
    ref = GenerationRef(name, str(Path(store.location) / dirname))
    return {
        file: info.size
        for file, info in store.list_entries(ref).items()
        if info.unsafe is None and not file.startswith(".")
    }


def _held(entry: Any, rank: int) -> dict[str, dict[str, int]]:
    """What rank ``rank`` says its node holds, checked."""
    if not isinstance(entry, dict) or len(entry) > 64:
        raise PeerMessageError(f"rank {rank} sent a malformed list of memory generations")
    checked: dict[str, dict[str, int]] = {}
    for dirname, files in entry.items():
        if not isinstance(dirname, str) or parse_generation_dirname(dirname) is None:
            raise PeerMessageError(f"rank {rank} named {str(dirname)[:80]!r}, not a generation")
        checked[dirname] = _file_list({"files": files}, rank)
    return checked


def _file_list(entry: Any, rank: int) -> dict[str, int]:
    files = entry.get("files") if isinstance(entry, dict) else None
    if not isinstance(files, dict) or len(files) > MAX_FILES:
        raise PeerMessageError(f"rank {rank} sent a malformed file list")
    for name, size in files.items():
        plain = isinstance(name, str) and 0 < len(name) <= MAX_NAME and "/" not in name
        if not plain or name in (".", "..") or name.startswith("."):
            raise PeerMessageError(f"rank {rank} named a file {str(name)[:80]!r}")
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size < 1 << 44:
            raise PeerMessageError(f"rank {rank} gave {name} a size of {str(size)[:40]}")
    return files


def _open_plain(path: Path) -> IO[bytes]:
    """A plain file, never through a link and never blocking on a FIFO."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeEntryError(f"{path} is not a plain file; it is not sent")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


class _Buffer:
    def __init__(self, into: bytearray) -> None:
        self.into = into

    def write(self, data: bytes) -> int:
        self.into += data
        return len(data)

    def commit(self) -> None:
        pass

    def abort(self) -> None:
        pass
