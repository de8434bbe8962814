"""``CheckpointManager``: the front door. It orchestrates; the layers below own the details.

Save: capture the state (tensors + JSON tree) -> write tensors through DCP into a
staging area (hashed, fsync'd) -> build the manifest -> publish atomically.

Restore: list generations newest first -> for each candidate: structural checks,
then read every byte with digest verification into private buffers -> the first
candidate that passes is matched against the live objects (contract, keys, shapes)
-> applied in place, RNG last. A candidate that fails is skipped with its reason;
a restore that raises leaves ``state`` untouched.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, NamedTuple

from ckptvault._version import __version__
from ckptvault.errors import FormatError, IntegrityError, NoValidCheckpoint, UsageError
from ckptvault.format.layout import generation_created_at, new_generation_id
from ckptvault.format.manifest import Manifest
from ckptvault.io.dcp_io import read_tensors, write_tensors
from ckptvault.io.writer import default_threads
from ckptvault.state.apply import plan_restore
from ckptvault.state.capture import capture_state, decode_tree
from ckptvault.state.contract import (
    build_contract,
    code_revision,
    compare_contracts,
    encode_contract_fields,
)
from ckptvault.storage.base import GenerationRef
from ckptvault.storage.listing import GenerationInfo, list_generation_infos
from ckptvault.storage.posix import PosixStore
from ckptvault.trust.checks import GenerationRejected, Problem, check_structure
from ckptvault.trust.digests import DEFAULT_CHUNK_SIZE

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


class SaveHandle:
    """The outcome of one ``save``. Synchronous saves are done when it is returned."""

    def __init__(self, info: GenerationInfo, seconds: float) -> None:
        self._info = info
        self.seconds = seconds

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> GenerationInfo:
        return self._info

    def __repr__(self) -> str:
        info = self._info
        return f"SaveHandle(step={info.step}, generation_id={info.generation_id!r}, done=True)"


def _validate_step(step: Any) -> int:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise UsageError(f"step must be a non-negative int, got {step!r}")
    return step


class CheckpointManager:
    """Saves and restores the training state of one run in one store.

    Args:
        directory: the store, a local directory (``str`` or ``os.PathLike``).
        run_id: this run's identity, recorded in every manifest; restore skips
            generations of other runs. Defaults to the store directory's name.
        contract: what the numbers mean (config, dataset identity, ...): plain
            values, dataclasses or paths. Restore raises ``ContractMismatch`` when it
            differs from the stored one. ``None`` records nothing and checks nothing.
        threads: worker threads for writing and verifying (default: up to 8).
        chunk_size: bytes per digest chunk in the manifest (default 4 MiB).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        run_id: str | None = None,
        contract: Mapping[str, Any] | None = None,
        threads: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
    ) -> None:
        self.store = PosixStore(directory)
        self.run_id = run_id if run_id is not None else os.path.basename(self.store.location)
        if not isinstance(self.run_id, str) or not self.run_id or len(self.run_id) > 256:
            raise UsageError(
                f"run_id must be a non-empty string of at most 256 characters, got {run_id!r}"
            )
        if chunk_size <= 0:
            raise UsageError(f"chunk_size must be positive, got {chunk_size}")
        self.threads = threads or default_threads()
        self.chunk_size = chunk_size
        self._contract_fields = dict(contract) if contract is not None else None
        encode_contract_fields(self._contract_fields or {})  # fail now, not at the first save
        self._contract = build_contract(self._contract_fields, code_revision())
        self._parent: str | None = None
        self._closed = False

    # -- saving ------------------------------------------------------------------------

    def save(self, step: int, state: Mapping[str, Any]) -> SaveHandle:
        """Save ``state`` as a new generation of ``step``; durable when this returns."""
        step = _validate_step(step)
        self._check_open()
        started = time.perf_counter()
        captured = capture_state(state)  # unsupported values fail here, before any I/O
        self.store.acquire_writer()
        self.store.remove_stale_staging()
        generation_id = new_generation_id()
        staging = self.store.begin_generation(generation_id)
        try:
            dcp_json, records = write_tensors(
                captured.tensors, staging, self.chunk_size, self.threads
            )
            manifest = Manifest(
                run_id=self.run_id,
                step=step,
                generation_id=generation_id,
                created_at=generation_created_at(generation_id),
                parent=self._parent,
                chunk_size=self.chunk_size,
                files=records,
                dcp=dcp_json,
                state=captured.tree,
                contract=self._contract,
                writer={"ckptvault": __version__, "world_size": 1},
            )
            ref = staging.publish(step, manifest.to_bytes())
        except BaseException:
            staging.abort()
            raise
        self._parent = generation_id
        info = GenerationInfo(
            step, generation_id, ref.location, manifest.total_bytes, manifest.created_at
        )
        return SaveHandle(info, time.perf_counter() - started)

    def wait(self) -> None:
        """Wait for saves in flight (synchronous saves never leave any)."""

    # -- restoring ---------------------------------------------------------------------

    def restore(
        self,
        state: MutableMapping[str, Any],
        step: int | None = None,
        strict: bool = True,
        allow_contract_change: bool = False,
    ) -> RestoreInfo | None:
        """Restore the newest generation (of ``step``, when given) that verifies.

        Returns ``None`` when the store holds no generation at all. Raises
        ``NoValidCheckpoint`` when generations exist but none verifies,
        ``ContractMismatch`` or ``StateMismatchError`` when the verified generation
        does not fit the live objects; in every raising case ``state`` is untouched.
        """
        self._check_open()
        started = time.perf_counter()
        candidates = self.store.list_generations()
        if not candidates:
            if step is not None:
                raise NoValidCheckpoint(
                    f"store {self.store.location} holds no generation (asked for step {step})"
                )
            return None
        if step is not None:
            step = _validate_step(step)
            available = sorted({ref.step for ref in candidates})
            candidates = [ref for ref in candidates if ref.step == step]
            if not candidates:
                raise NoValidCheckpoint(
                    f"store {self.store.location} has no generation of step {step}; "
                    f"steps present: {_summarize_steps(available)}"
                )
        skipped: list[SkippedGeneration] = []
        for ref in candidates:
            try:
                manifest, saved, nbytes = self._load_candidate(ref)
            except GenerationRejected as rejected:
                logger.warning("skipping %s: %s", ref.location, rejected.reason)
                skipped.append(SkippedGeneration(ref.generation_id, ref.step, rejected.reason))
                continue
            where = f"generation {ref.generation_id} (step {ref.step})"
            if self._contract_fields is not None and not allow_contract_change:
                compare_contracts(manifest.contract, self._contract_fields, where)
            plan = plan_restore(state, saved, strict)
            if strict and not plan.clean:
                raise plan.mismatch_error(where)
            plan.apply()
            self._parent = ref.generation_id
            return RestoreInfo(
                step=ref.step,
                generation_id=ref.generation_id,
                path=ref.location,
                skipped=skipped,
                missing=plan.missing,
                unexpected=plan.unexpected,
                mismatched=plan.mismatched,
                bytes=nbytes,
                seconds=time.perf_counter() - started,
            )
        raise NoValidCheckpoint(
            f"no generation in {self.store.location} passed verification; nothing was restored "
            "and state is unchanged. Run `ckptvault verify --all` on the store for details",
            [tuple(s) for s in skipped],
        )

    def _load_candidate(self, ref: GenerationRef) -> tuple[Manifest, dict[str, Any], int]:
        """Verify one candidate completely and decode it; raises GenerationRejected."""
        checked = check_structure(self.store, ref, self.run_id)
        manifest = checked.manifest
        where = f"generation {ref.generation_id}"
        try:
            tensors = read_tensors(self.store, ref, manifest, self.threads)
            saved = decode_tree(manifest.state, tensors, where)
        except IntegrityError as exc:
            raise GenerationRejected(ref, [Problem("digest-mismatch", str(exc))]) from exc
        except FormatError as exc:
            raise GenerationRejected(ref, [Problem("manifest-invalid", str(exc))]) from exc
        except OSError as exc:
            raise GenerationRejected(ref, [Problem("unreadable", f"{exc}")]) from exc
        return manifest, saved, manifest.total_bytes

    # -- listing -----------------------------------------------------------------------

    def generations(self) -> list[GenerationInfo]:
        """Published generations, newest first (not verified; see ``ckptvault verify``)."""
        return list_generation_infos(self.store)

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        """Wait for saves in flight and release the store's writer lock."""
        if self._closed:
            return
        self.wait()
        self.store.release_writer()
        self._closed = True

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
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.store.location!r}, run_id={self.run_id!r})"


def _summarize_steps(steps: list[int]) -> str:
    if len(steps) <= 12:
        return ", ".join(str(s) for s in steps)
    return ", ".join(str(s) for s in steps[:5]) + ", ..., " + ", ".join(str(s) for s in steps[-5:])
