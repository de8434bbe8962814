"""Tiers: copy published generations from one store to another, verified.

Training writes to a fast local tier, restorable at once; a :class:`Replicator`
(an event subscriber) copies each published generation to a slower, durable tier
in the background. A copy goes through the target's own publish rule — data
first, manifest last — so a crash mid-copy leaves nothing visible there, and every
byte is checked against the source manifest's chunk digests on its way through,
so a copy is never better than verified. :func:`copy_generation` is also how a
restore from the remote tier is brought back to the local one.

A copy satisfies what a restore of it would require, before a byte is copied: the
run's id and trusted keys, and in an encrypted run (a key store is given) every file
encrypted and the manifest's MAC authenticated by the run's key
(:func:`~ckptvault.io.load.check_authenticity`). Whoever can write only the local
tier therefore cannot plant a generation there that the durable tier takes in,
counts as verified and keeps in place of genuine ones.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import partial
from typing import TYPE_CHECKING, Any

from blake3 import blake3

from ckptvault.errors import (
    CheckpointError,
    FormatError,
    IntegrityError,
    KeyDestroyedError,
    UsageError,
)
from ckptvault.events import Event, EventBus, Published, Replicated
from ckptvault.format.layout import MANIFEST_NAME, SIGNATURE_NAME, GenerationName, utc_now
from ckptvault.format.manifest import Manifest
from ckptvault.progress import Meter, Progress
from ckptvault.retention.marks import read_marks
from ckptvault.storage import StoreLocation, open_store
from ckptvault.storage.base import GenerationRef, StagingArea, Store, write_new_file
from ckptvault.storage.records import REPLICA
from ckptvault.trust.authenticity import check_authenticity
from ckptvault.trust.checks import MAX_SIGNATURE_BYTES, TrustPolicy, check_structure
from ckptvault.trust.context import TrustContext
from ckptvault.trust.digests import ChunkVerifier, read_full
from ckptvault.trust.keystore import KeyStore
from ckptvault.trust.problems import GenerationRejected

if TYPE_CHECKING:
    from ckptvault.retention.keeper import RetentionKeeper

logger = logging.getLogger("ckptvault")
# Failures a second try cannot fix: the source does not verify, or the target holds
# something else under its name, or the run's key was destroyed.
_PERMANENT = (IntegrityError, FormatError, GenerationRejected, UsageError, KeyDestroyedError)
REPLICA_RECORD = REPLICA
COPY_BLOCK = 8 * 1024 * 1024


def find_generation(store: Store, name: GenerationName) -> GenerationRef | None:
    """The generation of exactly this step and id (a planted directory that reuses
    the id under another step is a different name)."""
    return next((ref for ref in store.list_generations() if ref.name == name), None)


def copy_generation(
    source: Store,
    ref: GenerationRef,
    target: Store,
    policy: TrustPolicy | None = None,
    keystore: KeyStore | None = None,
    progress: Progress | None = None,
) -> GenerationRef:
    """Copy one published generation, verified, into ``target`` under the same name.

    The source is checked first as a restore would check it: its structure (the
    manifest parses, files are ours, run id and signature as ``policy`` asks), and
    with ``keystore`` (an encrypted run) every file encrypted and the manifest's MAC
    made with the run's key; an encrypted generation is refused without one. Every
    byte is verified against its chunk digests as it is copied, and the target
    publishes the source's exact manifest and signature bytes last. Returns the
    target's generation; an existing copy is left as it is (and ``progress`` is not
    called). ``progress(done, total)`` follows the bytes copied (see
    :mod:`ckptvault.progress`). Raises :class:`GenerationRejected` when the source
    does not verify.
    """
    checked = check_structure(source, ref, policy)
    check_authenticity(checked, keystore, require_encryption=keystore is not None)
    manifest = checked.manifest
    manifest_bytes = source.read_bytes(ref, MANIFEST_NAME, len(checked.manifest_bytes))
    if manifest_bytes != checked.manifest_bytes:  # changed since it was checked
        raise IntegrityError(f"{ref.location}: the manifest changed while it was being copied")
    existing = find_generation(target, ref.name)
    if existing is not None:
        # Already there, or something planted under its name: only the same manifest
        # bytes count as a copy (restore still verifies every byte of it).
        if target.read_bytes(existing, MANIFEST_NAME, len(manifest_bytes)) != manifest_bytes:
            raise IntegrityError(
                f"{existing.location} holds a different generation under the name of "
                f"{ref.location}; remove it, then replicate again"
            )
        return existing
    names = source.list_entries(ref)
    signature = (
        source.read_bytes(ref, SIGNATURE_NAME, MAX_SIGNATURE_BYTES)
        if SIGNATURE_NAME in names
        else None
    )
    staging = target.begin_generation(ref.generation_id)
    try:
        _copy_files(source, ref, manifest, staging, Meter(progress, manifest.total_bytes))
        return staging.publish(ref.step, manifest_bytes, signature)
    except BaseException:
        staging.abort()
        raise


def _copy_files(
    source: Store, ref: GenerationRef, manifest: Manifest, staging: StagingArea, meter: Meter
) -> None:
    """Every file of ``ref`` into ``staging``, each block verified before it is written."""
    for name, index in sorted((manifest.indexes or {}).items()):  # format 3
        data = source.read_bytes(ref, name, index.size)
        if len(data) != index.size or blake3(data).hexdigest() != index.blake3:
            raise IntegrityError(f"{ref.location}: {name} changed while it was being copied")
        write_new_file(staging, name, data)
    buffer = memoryview(bytearray(min(COPY_BLOCK, manifest.chunk_size)))
    for name, record in sorted(manifest.files.items()):
        verifier = ChunkVerifier(record, manifest.chunk_size, name, whole_file=False)
        sink = staging.create_file(name)
        try:
            with source.open_file(ref, name) as stream:
                while count := read_full(stream, buffer):
                    verifier.update(buffer[:count])  # raises before a bad byte is written
                    sink.write(buffer[:count])
                    meter(count)
            verifier.finish()
        except BaseException:
            sink.abort()
            raise
        sink.commit()


@dataclass(frozen=True)
class ReplicationStatus:
    """Where replication stands: what waits, and for how long the oldest has."""

    pending: int
    lag_seconds: float  # 0 when every published generation has been copied
    failures: int


class Replicator:
    """Copies each published generation to ``target`` on one background thread.

    Subscribe it to the manager's events. ``wait()`` blocks until every copy in
    flight finished; ``close()`` waits, then stops the thread. A copy that failed
    for a passing reason (network, a busy target) is logged, counted and tried again
    after the next publish; one whose source does not verify is given up. Either way
    it never fails a save. Until a generation is copied it is *unreplicated*
    (:meth:`unreplicated`): the local tier's retention treats it as in flight and
    keeps it. Each finished copy is told to the event subscribers as
    :class:`~ckptvault.events.Replicated` (the replica tier's retention runs then).

    With ``catch_up`` (the manager's replicator), the first publish also queues what
    an earlier process left uncopied: the source's unmarked generations newer than
    the target's newest that the target does not hold. With ``recorded`` (the run's
    publishes its ledger remembers), only those among them: a generation someone put
    into the source's directory was never published by this run, whatever it says.

    Every copy is checked as a restore would check it (``policy``, and ``keystore``
    in an encrypted run; see :func:`copy_generation`) before it counts as replicated.
    """

    def __init__(
        self,
        source: Store,
        target: Store,
        policy: TrustPolicy | None = None,
        *,
        emit: Callable[[Event], None] | None = None,
        run_id: str | None = None,
        catch_up: bool = False,
        keystore: KeyStore | None = None,
        recorded: Callable[[], list[GenerationName]] | None = None,
    ) -> None:
        self.source = source
        self.target = target
        self.policy = policy  # run id and trusted keys a copy must satisfy
        self.keystore = keystore  # an encrypted run: encryption and manifest MAC too
        self._recorded = recorded  # the ledger's record of the run's publishes, if kept
        self.run_id = run_id
        self.retention: RetentionKeeper | None = None  # the target's own, when it has one
        self._emit = emit
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptvault-replicate")
        self._lock = threading.Lock()
        self._pending: dict[str, float] = {}  # generation id -> when it was published
        self._retry: dict[str, tuple[GenerationRef, float]] = {}  # failed, tried again later
        self._futures: list[Future[None]] = []
        self._failures = 0
        self._target_locked = False
        self._catch_up = catch_up

    @classmethod
    def attach(
        cls,
        source: Store,
        target: StoreLocation | None,
        events: EventBus,
        trust: TrustContext,
        run_id: str,
        store_options: dict[str, Any] | None = None,
    ) -> Replicator | None:
        """A replicator to ``target`` subscribed to ``events``, or None without a target.
        ``store_options``: ``open_store`` keywords for the target (its backend's options,
        :meth:`~ckptvault.storage.RemoteOptions.for_location`)."""
        if target is None:
            return None
        remote = open_store(target, **(store_options or {}))
        if remote.location == source.location:
            raise UsageError(f"replicate_to names the store itself ({remote.location})")
        trust.check_outside(remote)  # keys, ledger and audit log stay out of every tier
        replicator = cls(
            source,
            remote,
            trust.policy(run_id, floor=None),
            emit=events.emit,
            run_id=run_id,
            catch_up=True,
            keystore=trust.keystore,
            recorded=partial(trust.published, run_id) if trust.ledger is not None else None,
        )
        events.subscribe(replicator)
        return replicator

    def __call__(self, event: Event) -> None:
        if not isinstance(event, Published):
            return
        # Exactly what was published (step and id, at its location): never a look-up
        # by id, which a directory planted under another step could answer.
        ref = GenerationRef(GenerationName(event.step, event.generation_id), event.location)
        published_at = time.monotonic() - event.seconds
        # Listed now, on the publishing thread, so that retention (which runs next)
        # already counts what an earlier process left uncopied as in flight.
        behind = self._behind(ref) if self._catch_up else []
        self._catch_up = False
        with self._lock:
            queue = [(ref, published_at), *self._retry.values()]
            queue += [(old, published_at) for old in behind]
            self._retry.clear()
            self._futures = [f for f in self._futures if not f.done()]
            for copy, since in queue:
                if copy.generation_id in self._pending:
                    continue
                self._pending[copy.generation_id] = since
                self._futures.append(self._pool.submit(self._replicate, copy))

    def unreplicated(self) -> frozenset[str]:
        """Ids of generations published here and not yet copied (queued, copying, or
        to be tried again)."""
        with self._lock:
            return frozenset(self._pending) | frozenset(self._retry)

    def _behind(self, published: GenerationRef) -> list[GenerationRef]:
        """The source's unmarked generations newer than the target's newest that the
        target lacks (what an earlier process did not get to copy), newest first; with
        a ledger, only those it recorded as published by this run."""
        try:
            recorded = set(self._recorded()) if self._recorded is not None else None
            held = {ref.name for ref in self.target.list_generations()}
            newest = max(held, default=None)
            marked = read_marks(self.source, datetime.now(timezone.utc))
            return [
                ref
                for ref in self.source.list_generations()
                if ref.name != published.name
                and (recorded is None or ref.name in recorded)
                and ref.name not in held
                and ref.name not in marked
                and (newest is None or ref.name > newest)
            ]
        except (CheckpointError, OSError) as exc:
            logger.warning(
                "could not compare %s with %s to copy what an earlier run left uncopied: %s",
                self.source.location,
                self.target.location,
                exc,
            )
            return []

    def _replicate(self, ref: GenerationRef) -> None:
        copied = self._copy(ref)
        if copied is None or self._emit is None:
            return
        try:
            self._emit(
                Replicated(
                    self.run_id,
                    self.source.location,
                    self.target.location,
                    ref.step,
                    ref.generation_id,
                    copied.location,
                )
            )
        except (CheckpointError, OSError) as exc:  # the copy exists either way
            logger.error("after copying %s to %s: %s", ref.location, self.target.location, exc)

    def _copy(self, ref: GenerationRef) -> GenerationRef | None:
        """Copy one generation; None when it was not copied (gone, or failed)."""
        generation_id = ref.generation_id
        retry = False
        try:
            if find_generation(self.source, ref.name) is None:
                return None  # deleted (retention) before it could be copied
            if not self._target_locked:
                self.target.acquire_writer()
                self._target_locked = True
            copied = copy_generation(self.source, ref, self.target, self.policy, self.keystore)
            self.source.put_record(
                REPLICA_RECORD,
                ref.name.dirname,
                {"tiers": [self.target.location], "verified_at": utc_now()},
            )
            logger.info("replicated %s to %s", ref.location, copied.location)
            return copied
        except (CheckpointError, OSError) as exc:
            # A source that does not verify never will; anything else may pass.
            retry = not isinstance(exc, _PERMANENT)
            with self._lock:
                self._failures += 1
            logger.error(
                "replicating generation %s to %s failed: %s%s",
                generation_id,
                self.target.location,
                exc,
                "; tried again after the next save" if retry else "",
            )
            return None
        finally:
            with self._lock:
                since = self._pending.pop(generation_id, None)
                if retry and since is not None:
                    self._retry[generation_id] = (ref, since)

    def fetch(self, tier: Store, ref: GenerationRef) -> None:
        """Copy a generation restored from ``tier`` back into the local tier, in the
        background: the next restore on this node is local again."""
        with self._lock:
            self._futures.append(self._pool.submit(self._fetch, tier, ref))

    def _fetch(self, tier: Store, ref: GenerationRef) -> None:
        try:
            self.source.acquire_writer()  # no concurrent cleanup of our staging area
            copied = copy_generation(tier, ref, self.source, self.policy, self.keystore)
            logger.info("copied %s back to the local tier as %s", ref.location, copied.location)
        except (CheckpointError, OSError) as exc:
            with self._lock:
                self._failures += 1
            logger.error(
                "copying %s back to %s failed: %s", ref.location, self.source.location, exc
            )

    def status(self) -> ReplicationStatus:
        with self._lock:
            waiting = [*self._pending.values(), *(since for _ref, since in self._retry.values())]
            oldest = min(waiting, default=None)
            lag = 0.0 if oldest is None else time.monotonic() - oldest
            return ReplicationStatus(len(waiting), lag, self._failures)

    def wait(self) -> None:
        with self._lock:
            futures = list(self._futures)
        for future in futures:
            future.result()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
            if self._target_locked:
                self.target.release_writer()
                self._target_locked = False
