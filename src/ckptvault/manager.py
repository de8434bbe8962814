"""``CheckpointManager``: the front door. It orchestrates; the layers below own the details.

Save: capture the state (tensors + JSON tree) -> write tensors through DCP into a
staging area (hashed, optionally encrypted, fsync'd) -> build the manifest -> sign
it -> publish atomically -> record in the audit log.

Restore: list generations newest first -> for each candidate: the restore checks
(signature, run, floor, files, formats), then read every byte with digest
verification (and decryption) into private buffers -> the first candidate that
passes is matched against the live objects (contract, keys, shapes) -> applied in
place, RNG last -> the ledger's floor and the audit log are updated. A candidate
that fails is skipped with its reason; a restore that raises leaves ``state``
untouched.
"""

from __future__ import annotations

import base64
import concurrent.futures
import logging
import os
import secrets
import time
import warnings
import weakref
from collections.abc import Iterable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

from ckptvault._version import __version__
from ckptvault.errors import (
    AuditError,
    CheckpointError,
    KeyUnavailableError,
    NoValidCheckpoint,
    RollbackError,
    UsageError,
)
from ckptvault.format.container import CIPHER, DEFAULT_SEGMENT_SIZE
from ckptvault.format.layout import generation_created_at, new_generation_id
from ckptvault.format.manifest import MAX_CHUNK_SIZE, Manifest
from ckptvault.io.dcp_io import write_tensors
from ckptvault.io.handles import SaveHandle, SaveStats
from ckptvault.io.load import load_verified
from ckptvault.io.planners import forget_cached_plans
from ckptvault.io.staging import StagingPool
from ckptvault.io.writer import default_threads
from ckptvault.state.apply import plan_restore
from ckptvault.state.capture import CapturedState, capture_state
from ckptvault.state.contract import (
    build_contract,
    code_revision,
    compare_contracts,
    encode_contract_fields,
)
from ckptvault.storage.base import GenerationRef
from ckptvault.storage.listing import GenerationInfo, list_generation_infos
from ckptvault.storage.posix import PosixStore
from ckptvault.trust.audit import AuditLog, default_audit_path
from ckptvault.trust.checks import (
    ROLLBACK,
    GenerationRejected,
    TrustPolicy,
)
from ckptvault.trust.digests import DEFAULT_CHUNK_SIZE
from ckptvault.trust.envelope import FileEncryption
from ckptvault.trust.keystore import KeyStore, open_keystore
from ckptvault.trust.ledger import Ledger, RestoreFloor, default_ledger_path
from ckptvault.trust.signing import (
    MANIFEST_DOMAIN,
    PrivateKeyLike,
    PublicKeyLike,
    TrustedKeys,
    key_id,
    load_private_key,
    sign,
)

logger = logging.getLogger("ckptvault")


class SkippedGeneration(NamedTuple):
    generation_id: str
    step: int
    reason: str


@dataclass(frozen=True)
class RestoreInfo:
    """What ``restore`` applied, and every newer generation it rejected and why."""

    step: int
    generation_id: str
    path: str
    skipped: list[SkippedGeneration] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)
    bytes: int = 0
    seconds: float = 0.0
    signer: str | None = None


def _validate_step(step: Any, what: str = "step") -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UsageError(f"{what} must be a non-negative int, got {step!r}")
    return step


def _outside_store(store_root: Path, path: Path, what: str, why: str) -> None:
    resolved, root = path.resolve(), store_root.resolve()
    if resolved == root or root in resolved.parents:
        raise UsageError(f"the {what} ({path}) is inside the checkpoint store {store_root}; {why}")


class CheckpointManager:
    """Saves and restores the training state of one run in one store.

    Args:
        directory: the store, a local directory (``str`` or ``os.PathLike``).
        run_id: this run's identity, recorded in every manifest; restore skips
            generations of other runs. Defaults to the store directory's name.
        contract: what the numbers mean (config, dataset identity, ...): plain
            values, dataclasses or paths. Restore raises ``ContractMismatch`` when it
            differs from the stored one. ``None`` records nothing and checks nothing.
        signing_key: an Ed25519 private key (object or PEM path); every manifest is
            signed with it (``manifest.sig``).
        trusted_keys: Ed25519 public keys (objects or PEM paths); restore refuses
            generations not signed by one of them. Turns on the rollback floor.
        keystore: a key store (or the directory of a ``LocalKeyStore``) holding the
            run's key-encryption key; turns on encryption of every tensor file.
        ledger: where the rollback floor is kept (outside the store); default a
            per-user state directory. Giving it, or ``trusted_keys``, turns on the
            floor.
        audit_log: the hash-chained audit log (default beside the ledger); written
            whenever any trust feature is on.
        async_save: make ``save`` asynchronous by default (copy, return, write in the
            background).
        max_in_flight: background saves allowed at once (each holds one staged copy).
        if_busy: when ``max_in_flight`` saves are running, ``"wait"`` for the oldest,
            or ``"skip"`` the new save with a warning (counted in ``stats``).
        threads: worker threads for writing and verifying (default: up to 8).
        chunk_size: bytes per digest chunk in the manifest (default 4 MiB).
        segment_size: plaintext bytes per encrypted segment (default 1 MiB).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        run_id: str | None = None,
        contract: Mapping[str, Any] | None = None,
        signing_key: PrivateKeyLike | None = None,
        trusted_keys: Iterable[PublicKeyLike] | None = None,
        keystore: str | os.PathLike[str] | KeyStore | None = None,
        ledger: str | os.PathLike[str] | None = None,
        audit_log: str | os.PathLike[str] | None = None,
        async_save: bool = False,
        max_in_flight: int = 1,
        if_busy: str = "wait",
        threads: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
    ) -> None:
        self.store = PosixStore(directory)
        self.run_id = run_id if run_id is not None else os.path.basename(self.store.location)
        if not isinstance(self.run_id, str) or not self.run_id or len(self.run_id) > 256:
            raise UsageError(
                f"run_id must be a non-empty string of at most 256 characters, got {run_id!r}"
            )
        if not (0 < chunk_size <= MAX_CHUNK_SIZE and 0 < segment_size <= MAX_CHUNK_SIZE):
            raise UsageError(
                f"chunk_size and segment_size must be positive, got {chunk_size}, {segment_size}"
            )
        self.threads = threads or default_threads()
        self.chunk_size = chunk_size
        self.segment_size = segment_size
        self._contract_fields = dict(contract) if contract is not None else None
        encode_contract_fields(self._contract_fields or {})  # fail now, not at the first save
        self._contract = build_contract(self._contract_fields, code_revision())

        self._signing_key = load_private_key(signing_key) if signing_key is not None else None
        if isinstance(trusted_keys, (str, bytes, os.PathLike)) or hasattr(
            trusted_keys, "public_bytes"
        ):
            trusted_keys = [trusted_keys]  # type: ignore[list-item]  # one key given alone
        self._trusted = TrustedKeys.load(trusted_keys) if trusted_keys is not None else None
        self._keystore = open_keystore(keystore) if keystore is not None else None
        keystore_location = getattr(self._keystore, "location", None)
        if keystore_location:
            _outside_store(
                self.store.root,
                Path(keystore_location),
                "key store",
                "keys must not live beside what they protect; a copy of the store would carry them",
            )
        floor_on = ledger is not None or trusted_keys is not None
        self._ledger = (
            Ledger(ledger if ledger is not None else default_ledger_path()) if floor_on else None
        )
        if self._ledger is not None:
            _outside_store(
                self.store.root,
                self._ledger.path,
                "ledger",
                "whoever can write the store could then lower the rollback floor",
            )
        audit_on = (
            floor_on or keystore is not None or signing_key is not None or audit_log is not None
        )
        self._audit = (
            AuditLog(
                audit_log if audit_log is not None else default_audit_path(),
                self._ledger or Ledger(default_ledger_path()),
            )
            if audit_on
            else None
        )
        if self._audit is not None:
            _outside_store(
                self.store.root,
                self._audit.path,
                "audit log",
                "whoever can write the store could then rewrite the record of what happened",
            )
        if max_in_flight < 1 or if_busy not in ("wait", "skip"):
            raise UsageError(
                f"max_in_flight must be >= 1 and if_busy 'wait' or 'skip', got {max_in_flight}, {if_busy!r}"
            )
        self.async_save = async_save
        self.max_in_flight = max_in_flight
        self.if_busy = if_busy
        self.stats = SaveStats()
        self._staging = StagingPool(max_in_flight)
        self._in_flight: list[SaveHandle] = []
        self._pool: ThreadPoolExecutor | None = None
        self._parent: str | None = None
        self._plan_cache_key = secrets.token_hex(8)
        self._closed = False

    # -- saving ------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any], blocking: bool | None = None) -> SaveHandle:
        """Save ``state`` as a new generation of ``step``.

        Synchronous (the default unless ``async_save=True``): the generation is durable
        when this returns. Asynchronous (``blocking=False``): returns as soon as the
        state is copied into staging buffers; writing and publishing happen in the
        background, and an error surfaces from the handle, the next ``save``,
        ``wait`` or ``close``.
        """
        step = _validate_step(step)
        self._check_open()
        self._raise_background_error()
        blocking = not self.async_save if blocking is None else blocking
        started = time.perf_counter()
        if self._keystore is not None:
            self._keystore.ensure_usable(self.run_id)  # KeyDestroyedError after crypto-erase
        captured = capture_state(state)  # unsupported values fail here, before any I/O
        self.store.acquire_writer()
        self.stats.saves_started += 1
        if blocking:
            self._drain()  # generations publish in the order they were asked for
            info = self._publish_generation(step, captured)
            seconds = time.perf_counter() - started
            self.stats.last_stall_seconds = self.stats.last_save_seconds = seconds
            return SaveHandle.completed(info, seconds)
        if not self._make_room(step):
            return SaveHandle(step, None, time.perf_counter() - started, skipped=True)
        slot = self._staging.next_slot()
        staged = CapturedState(captured.tree, slot.stage(captured.tensors))
        self.stats.staging_allocations = self._staging.allocations
        stall = time.perf_counter() - started
        self.stats.last_stall_seconds = stall
        handle = SaveHandle(
            step, self._executor().submit(self._publish_generation, step, staged), stall
        )
        self._in_flight.append(handle)
        return handle

    def _make_room(self, step: int) -> bool:
        """Apply backpressure; False when the save is skipped (``if_busy="skip"``)."""
        self._in_flight = [
            h for h in self._in_flight if not h.done() or (h.failed() and not h.reported)
        ]
        busy = [h for h in self._in_flight if not h.done()]
        if len(busy) < self.max_in_flight:
            return True
        if self.if_busy == "skip":
            self.stats.saves_skipped += 1
            warnings.warn(
                f"ckptvault: skipped the save of step {step}: {len(busy)} save(s) still in flight "
                f"(max_in_flight={self.max_in_flight}); save less often or raise max_in_flight",
                RuntimeWarning,
                stacklevel=3,
            )
            return False
        while len([h for h in self._in_flight if not h.done()]) >= self.max_in_flight:
            oldest = next(h for h in self._in_flight if not h.done())
            try:
                oldest.result()
            except BaseException:
                oldest.reported = True
                raise
        return True

    def _publish_generation(self, step: int, captured: CapturedState) -> GenerationInfo:
        """Write, sign and publish one generation; runs inline or on the worker thread."""
        started = time.perf_counter()
        try:
            self.store.remove_stale_staging()
            generation_id = new_generation_id()
            staging = self.store.begin_generation(generation_id)
            try:
                encryption = (
                    FileEncryption(self._keystore, self.run_id, generation_id, self.segment_size)
                    if self._keystore is not None
                    else None
                )
                writer = write_tensors(
                    captured.tensors,
                    staging,
                    self.chunk_size,
                    self.threads,
                    encryption,
                    plan_cache_key=self._plan_cache_key,
                )
                self.stats.plans_reused += int(writer.reused_plan)
                manifest = Manifest(
                    run_id=self.run_id,
                    step=step,
                    generation_id=generation_id,
                    created_at=generation_created_at(generation_id),
                    parent=self._parent,
                    chunk_size=self.chunk_size,
                    files=writer.file_records,
                    dcp=writer.dcp_json or {},
                    state=captured.tree,
                    contract=self._contract,
                    writer={"ckptvault": __version__, "world_size": 1},
                    encryption=self._encryption_section(writer.wrapped_keys)
                    if encryption
                    else None,
                )
                manifest_bytes = manifest.to_bytes()
                signature = (
                    sign(self._signing_key, manifest_bytes, MANIFEST_DOMAIN)
                    if self._signing_key is not None
                    else None
                )
                ref = staging.publish(step, manifest_bytes, signature)
            except BaseException:
                staging.abort()
                raise
        except BaseException:
            self.stats.saves_failed += 1
            raise
        self._parent = generation_id
        self.stats.saves_completed += 1
        self.stats.bytes_written += manifest.total_bytes
        self.stats.last_save_seconds = time.perf_counter() - started
        if self._audit is not None:
            self._record(
                f"generation {generation_id} (step {step}) was published",
                "save",
                run_id=self.run_id,
                step=step,
                generation_id=generation_id,
                store=self.store.location,
                bytes=manifest.total_bytes,
                signer=key_id(self._signing_key.public_key()) if self._signing_key else None,
                kek_id=(manifest.encryption or {}).get("kek_id"),
            )
        return GenerationInfo(
            step, generation_id, ref.location, manifest.total_bytes, manifest.created_at
        )

    def _record(self, done: str, event: str, **fields: Any) -> None:
        """Append to the audit log after the fact; a failure says what already happened."""
        assert self._audit is not None
        try:
            self._audit.append(event, **fields)
        except AuditError as exc:
            raise AuditError(f"{done}, but recording it in the audit log failed: {exc}") from exc

    def _encryption_section(self, wrapped_keys: dict[str, tuple[str, bytes]]) -> dict[str, Any]:
        kek_ids = {kek for kek, _ in wrapped_keys.values()}
        if len(kek_ids) > 1:
            raise KeyUnavailableError(
                f"files of one generation were wrapped by different keys ({sorted(kek_ids)}): the "
                "key store changed during the save. Nothing was published; check the key store "
                "and save again"
            )
        return {
            "cipher": CIPHER,
            "kek_id": kek_ids.pop() if kek_ids else "",
            "segment_size": self.segment_size,
            "files": {
                name: {"wrapped_key": base64.b64encode(wrapped).decode("ascii")}
                for name, (_kek, wrapped) in sorted(wrapped_keys.items())
            },
        }

    def wait(self) -> None:
        """Wait for every save in flight; raise the first background error not yet raised."""
        self._drain()
        self._raise_background_error()

    def _drain(self) -> None:
        for handle in list(self._in_flight):
            if handle._future is not None:
                concurrent.futures.wait([handle._future])

    def _raise_background_error(self) -> None:
        for handle in self._in_flight:
            if handle.failed() and not handle.reported:
                handle.reported = True
                error = handle.exception()
                assert error is not None
                raise error
        self._in_flight = [h for h in self._in_flight if not h.done()]

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            # One worker: background saves publish in order, one at a time.
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptvault-save")
            self._pool_finalizer = weakref.finalize(self, _shutdown_pool, self._pool)
        return self._pool

    # -- restoring ---------------------------------------------------------------------

    def restore(
        self,
        state: MutableMapping[str, Any],
        step: int | None = None,
        strict: bool = True,
        allow_contract_change: bool = False,
        allow_rollback_to: int | None = None,
    ) -> RestoreInfo | None:
        """Restore the newest generation (of ``step``, when given) that verifies.

        Returns ``None`` when the store holds no generation at all. Raises
        ``NoValidCheckpoint`` when generations exist but none verifies (``RollbackError``
        when any was refused for the rollback floor), ``ContractMismatch`` or
        ``StateMismatchError`` when the verified generation does not fit the live
        objects, ``KeyDestroyedError`` after crypto-erase; in every raising case
        ``state`` is untouched.

        ``allow_rollback_to=STEP`` restores the generation of ``STEP`` even below the
        floor; the floor is lowered to it and every newer generation is abandoned.
        """
        self._check_open()
        try:
            return self._restore(state, step, strict, allow_contract_change, allow_rollback_to)
        except CheckpointError as exc:
            if self._audit is not None and not isinstance(exc, AuditError):
                rejected = [list(r) for r in getattr(exc, "rejected", [])]
                try:
                    self._audit.append(
                        "refusal",
                        run_id=self.run_id,
                        store=self.store.location,
                        error=type(exc).__name__,
                        reason=str(exc).splitlines()[0][:2000],
                        rejected=rejected,
                    )
                except AuditError as audit_error:  # the refusal itself matters more
                    logger.error("could not record a refusal in the audit log: %s", audit_error)
            raise

    def _restore(
        self,
        state: MutableMapping[str, Any],
        step: int | None,
        strict: bool,
        allow_contract_change: bool,
        allow_rollback_to: int | None,
    ) -> RestoreInfo | None:
        started = time.perf_counter()
        if self._keystore is not None:
            self._keystore.ensure_usable(self.run_id)  # crypto-erased runs are gone for good
        if allow_rollback_to is not None and step is not None and step != allow_rollback_to:
            raise UsageError(
                f"step={step} and allow_rollback_to={allow_rollback_to} disagree; give one"
            )
        every = self.store.list_generations()
        floor = self._ledger.floor(self.run_id) if self._ledger is not None else None
        if allow_rollback_to is not None:
            step = _validate_step(allow_rollback_to, "allow_rollback_to")
            if floor is not None:  # below the floor is the point; abandoned stays abandoned
                floor = RestoreFloor(self.run_id, abandoned=floor.abandoned)
        candidates = every
        if not candidates and floor is not None and floor.step is not None:
            raise RollbackError(
                f"store {self.store.location} holds no generation, but run {self.run_id!r} "
                f"restored step {floor.step} before: refusing to start over silently. Restore "
                "the store from a copy, or start a new run id"
            )
        if not candidates:
            if step is not None:
                raise NoValidCheckpoint(
                    f"store {self.store.location} holds no generation (asked for step {step})"
                )
            return None
        if step is not None:
            step = _validate_step(step)
            candidates = [ref for ref in every if ref.step == step]
            if not candidates:
                available = sorted({ref.step for ref in every})
                raise NoValidCheckpoint(
                    f"store {self.store.location} has no generation of step {step}; "
                    f"steps present: {_summarize_steps(available)}"
                )
        policy = TrustPolicy(run_id=self.run_id, trusted_keys=self._trusted, floor=floor)
        skipped: list[SkippedGeneration] = []
        refused_for_floor = False
        for ref in candidates:
            try:
                manifest, saved, signer = self._load_candidate(ref, policy)
            except GenerationRejected as rejected:
                logger.warning("skipping %s: %s", ref.location, rejected.reason)
                skipped.append(SkippedGeneration(ref.generation_id, ref.step, rejected.reason))
                refused_for_floor |= ROLLBACK in rejected.codes
                continue
            where = f"generation {ref.generation_id} (step {ref.step})"
            if self._contract_fields is not None and not allow_contract_change:
                compare_contracts(manifest.contract, self._contract_fields, where)
            plan = plan_restore(state, saved, strict)
            if strict and not plan.clean:
                raise plan.mismatch_error(where)
            plan.apply(where)
            self._parent = ref.generation_id
            self._record_restore(ref, every, skipped, allow_rollback_to, floor)
            return RestoreInfo(
                step=ref.step,
                generation_id=ref.generation_id,
                path=ref.location,
                skipped=skipped,
                missing=plan.missing,
                unexpected=plan.unexpected,
                mismatched=plan.mismatched,
                bytes=manifest.total_bytes,
                seconds=time.perf_counter() - started,
                signer=signer,
            )
        rejected = [tuple(s) for s in skipped]
        if refused_for_floor:
            assert floor is not None
            above = (
                f"at or above the restore floor (step {floor.step})"
                if floor.step is not None
                else "that was not abandoned"
            )
            raise RollbackError(
                f"no generation of run {self.run_id!r} {above} passed verification; refusing to "
                "roll back silently. Restore from a good copy, or pass allow_rollback_to=STEP to "
                "roll back on purpose",
                rejected,
            )
        raise NoValidCheckpoint(
            f"no generation in {self.store.location} passed verification; nothing was restored "
            "and state is unchanged. Run `ckptvault verify --all` on the store for details",
            rejected,
        )

    def _record_restore(
        self,
        ref: GenerationRef,
        every: list[GenerationRef],
        skipped: list[SkippedGeneration],
        allow_rollback_to: int | None,
        floor: RestoreFloor | None,
    ) -> None:
        if self._ledger is not None:
            if allow_rollback_to is not None:
                previous = self._ledger.floor(self.run_id)
                abandoned = [(g.generation_id, g.step) for g in every if g.step > ref.step]
                self._ledger.lower_floor(self.run_id, ref.step, ref.generation_id, abandoned)
                if self._audit is not None:
                    self._record(
                        f"the rollback to step {ref.step} was applied",
                        "rollback_allowed",
                        run_id=self.run_id,
                        store=self.store.location,
                        previous_floor=previous.step,
                        step=ref.step,
                        generation_id=ref.generation_id,
                        abandoned=[list(a) for a in abandoned],
                    )
            else:
                self._ledger.record_restore(self.run_id, ref.step, ref.generation_id)
        if self._audit is not None:
            self._record(
                f"generation {ref.generation_id} (step {ref.step}) was restored",
                "restore",
                run_id=self.run_id,
                store=self.store.location,
                step=ref.step,
                generation_id=ref.generation_id,
                skipped=[list(s) for s in skipped],
            )

    def _load_candidate(
        self, ref: GenerationRef, policy: TrustPolicy
    ) -> tuple[Manifest, dict[str, Any], str | None]:
        loaded = load_verified(
            self.store,
            ref,
            policy,
            self._keystore,
            self.threads,
            require_encryption=self._keystore is not None,
        )
        return loaded.manifest, loaded.saved, loaded.signer

    # -- listing -----------------------------------------------------------------------

    def generations(self) -> list[GenerationInfo]:
        """Published generations, newest first (not verified; see ``ckptvault verify``)."""
        return list_generation_infos(self.store)

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Wait for saves in flight and release the store's writer lock.

        Raises the first background save error not raised before (after releasing)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._drain()
            self._raise_background_error()
        finally:
            if self._pool is not None:
                self._pool_finalizer.detach()
                self._pool.shutdown(wait=True)
            self.store.release_writer()
            forget_cached_plans(self._plan_cache_key)

    def _check_open(self) -> None:
        if self._closed:
            raise UsageError(f"this CheckpointManager for {self.store.location} is closed")

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
            return
        try:  # do not mask the exception that is already propagating
            self.close()
        except Exception as background:
            logger.error(
                "a background save failed while %s was propagating: %s",
                exc_type.__name__,
                background,
            )

    def __repr__(self) -> str:
        return f"CheckpointManager({self.store.location!r}, run_id={self.run_id!r})"


def _shutdown_pool(pool: ThreadPoolExecutor) -> None:
    """At interpreter exit (or when a manager is dropped unclosed): finish saves in flight."""
    pool.shutdown(wait=True)


def _summarize_steps(steps: list[int]) -> str:
    if len(steps) <= 12:
        return ", ".join(str(s) for s in steps)
    return ", ".join(str(s) for s in steps[:5]) + ", ..., " + ", ".join(str(s) for s in steps[-5:])
