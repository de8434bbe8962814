"""DCP's save steps across ranks, with ckptvault's collectives instead of DCP's.

``dcp.save`` on a process group carries plans and write results between ranks with
``gather_object`` / ``scatter_object_list`` / ``broadcast_object_list``: pickle.
Rank 0 — the rank that signs and publishes — would unpickle whatever another rank
sent, and run it. So ckptvault drives DCP's planner and its own storage writer
itself, in the order ``torch.distributed.checkpoint.state_dict_saver`` does, and
carries what crosses ranks as bounded JSON over the coordinator's gloo group
(:mod:`~ckptvault.distributed.plan_wire`, :mod:`~ckptvault.distributed.result_wire`):

1. every rank: ``set_up_planner``, ``set_up_storage_writer``, ``create_local_plan``,
   ``prepare_local_plan``; the plan is **gathered** to rank 0;
2. rank 0: ``create_global_plan`` (dedup: a replicated tensor written once) and
   ``prepare_global_plan``; each rank's part is **scattered** back as the positions
   of its own items to write;
3. every rank: ``finish_plan``, ``write_data``; its write results are **gathered**;
4. rank 0: ``finish`` (every rank's chunk locations, file records, wrapped keys);
   the verdict is **broadcast**, and every rank returns or raises it.

Every rank takes part in all four collectives whatever happens: a step that fails
(an I/O error, a refused message) becomes an error message in the next one, so no
rank is left waiting in a collective the others skipped, and every rank raises the
same :class:`~ckptvault.errors.SaveFailedError` naming the rank. Only a collective
that itself fails (a rank died: :class:`~ckptvault.errors.CollectiveError`) ends the
save at once. DCP's plan cache is not used here: DCP keeps it per process, keyed by
nothing ranks agree on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from ckptvault.coordinator import Coordinator
from ckptvault.distributed.plan_wire import (
    assigned_plan,
    assignment,
    check_agreement,
    plan_from_json,
    plan_to_json,
)
from ckptvault.distributed.result_wire import results_from_json, results_to_json
from ckptvault.distributed.wire import Field, error_message, error_of
from ckptvault.errors import PeerMessageError, SaveFailedError
from ckptvault.io.planners import TensorOnlySavePlanner
from ckptvault.io.writer import VaultStorageWriter
from ckptvault.storage.base import StagingArea
from ckptvault.trust.envelope import FileEncryption

T = TypeVar("T")
_MAX_NAMED = 4  # failed ranks named in a verdict; the rest are counted


def write_tensors_together(
    tensors: dict[str, torch.Tensor],
    staging: StagingArea,
    chunk_size: int,
    threads: int,
    encryption: FileEncryption | None,
    coordinator: Coordinator,
) -> VaultStorageWriter:
    """Write this rank's part of ``tensors`` (every rank calls it, collectively) into
    ``staging``, DCP's planner deciding who writes what. Returns the writer: on rank 0
    it holds every rank's DCP metadata, file records and wrapped keys. Raises the same
    SaveFailedError on every rank when any rank failed."""
    writer = VaultStorageWriter(
        staging,
        chunk_size=chunk_size,
        threads=threads,
        encryption=encryption,
        rank=coordinator.rank,
    )
    _SaveSteps(writer, coordinator, encryption is not None).run(tensors)
    if writer.dcp_json is None:  # ranks other than 0: the metadata is rank 0's
        writer.dcp_json = {"version": None, "tensors": {}}
    return writer


class _SaveSteps:
    """One collective save through DCP's planner (see the module docstring)."""

    def __init__(self, writer: VaultStorageWriter, coordinator: Coordinator, encrypted: bool):
        self.writer = writer
        self.coordinator = coordinator
        self.encrypted = encrypted
        self.planner = TensorOnlySavePlanner()
        self.world = coordinator.world_size
        self.failure: BaseException | None = None  # this rank's own, raised as the cause
        self.refusal: str | None = None  # rank 0: why the save fails, once it does
        self.central: list[SavePlan] = []  # rank 0: the global plan
        self.metadata: Metadata | None = None  # rank 0: DCP's global metadata

    def run(self, tensors: dict[str, torch.Tensor]) -> None:
        local = self._attempt(lambda: self._local_plan(tensors))
        sent = plan_to_json(local) if local is not None else error_message(self._failure())
        plans = self._gather(sent, "its plan")
        assignments = self._global_step(plans) if self.coordinator.is_coordinator else None
        received = self._scatter(assignments)
        results = None
        if local is not None and received is not None:
            results = self._attempt(lambda: self._write(local, received))
        sent = results if results is not None else error_message(self._failure())
        written = self._gather(sent, "its write results")
        verdict = self._finish(written) if self.coordinator.is_coordinator else {}
        verdict = self.coordinator.broadcast(verdict)
        error = error_of(verdict, Field(0, "a save verdict"))
        if error is not None:
            raise SaveFailedError(error) from self.failure
        Field(0, "a save verdict").mapping(verdict, ("ok",), "the verdict")

    # -- every rank ----------------------------------------------------------------------

    def _local_plan(self, tensors: dict[str, torch.Tensor]) -> SavePlan:
        is_coordinator = self.coordinator.is_coordinator
        # VaultStorageWriter.storage_meta() is None: the manifest, not DCP, says
        # where the checkpoint is.
        self.planner.set_up_planner(
            state_dict=tensors, storage_meta=None, is_coordinator=is_coordinator
        )
        self.writer.set_up_storage_writer(
            is_coordinator, rank=self.coordinator.rank, use_collectives=True
        )
        return self.writer.prepare_local_plan(self.planner.create_local_plan())

    def _write(self, local: SavePlan, received: Any) -> dict[str, Any]:
        plan = self.planner.finish_plan(assigned_plan(local, received))
        future = self.writer.write_data(plan, self.planner)
        future.wait()
        return results_to_json(future.value())

    def _attempt(self, step: Callable[[], T]) -> T | None:
        """``step``'s result, or None with its error kept to send (any Exception: the
        other ranks must hear of it; KeyboardInterrupt and the like end the save)."""
        try:
            return step()
        except Exception as exc:
            self.failure = self.failure or exc
            return None

    def _failure(self) -> BaseException:
        assert self.failure is not None  # every step that gives no result keeps why
        return self.failure

    def _gather(self, message: dict[str, Any], what: str) -> list[Any] | None:
        try:
            return self.coordinator.gather(message)
        except PeerMessageError as exc:  # rank 0 alone: the verdict tells the others
            self.refusal = self.refusal or f"rank 0 refused what a rank sent as {what}: {exc}"
            return None

    def _scatter(self, assignments: list[Any] | None) -> Any:
        """This rank's assignment, or None (the error to send is kept)."""
        try:
            received = self.coordinator.scatter(assignments)
        except PeerMessageError as exc:
            self.failure = self.failure or exc
            return None
        refused = error_of(received, Field(0, "a plan assignment"))
        if refused is not None:
            self.failure = self.failure or SaveFailedError(refused)
            return None
        return received

    # -- rank 0 --------------------------------------------------------------------------

    def _global_step(self, gathered: list[Any] | None) -> list[Any]:
        """Each rank's assignment, or the same error for every rank."""
        if gathered is not None and self.refusal is None:
            self._refuse_failed(gathered, "planning")
        if gathered is not None and self.refusal is None:
            try:
                plans = [plan_from_json(raw, rank) for rank, raw in enumerate(gathered)]
                check_agreement(plans)
                central, self.metadata = self.planner.create_global_plan(plans)
                self.central = self.writer.prepare_global_plan(central)
                return [
                    assignment(plans[rank], self.central[rank], rank) for rank in range(self.world)
                ]
            except Exception as exc:  # a refused plan, or DCP's own checks (ValueError ...)
                self.refusal = f"planning failed: {type(exc).__name__}: {exc}"
        return [{"error": self._verdict_text()}] * self.world

    def _finish(self, gathered: list[Any] | None) -> dict[str, Any]:
        if gathered is not None and self.refusal is None:
            self._refuse_failed(gathered, "writing")
        if gathered is not None and self.refusal is None:
            try:
                results = [
                    results_from_json(raw, rank, self.central[rank], self.world, self.encrypted)
                    for rank, raw in enumerate(gathered)
                ]
                assert self.metadata is not None
                self.writer.finish(metadata=self.metadata, results=results)
                return {"ok": True}
            except Exception as exc:
                self.refusal = f"collecting write results failed: {type(exc).__name__}: {exc}"
        return {"error": self._verdict_text()}

    def _refuse_failed(self, gathered: list[Any], what: str) -> None:
        """Name the ranks whose message is an error (PeerMessageError: a malformed one)."""
        try:
            failed = [
                (rank, error)
                for rank, message in enumerate(gathered)
                if (error := error_of(message, Field(rank, f"its {what}"))) is not None
            ]
        except PeerMessageError as exc:
            self.refusal = str(exc)
            return
        if failed:
            named = "; ".join(f"rank {rank}: {error}" for rank, error in failed[:_MAX_NAMED])
            more = f"; and {len(failed) - _MAX_NAMED} more" if len(failed) > _MAX_NAMED else ""
            ranks = ", ".join(str(rank) for rank, _error in failed[:_MAX_NAMED])
            self.refusal = f"{what} failed on rank {ranks} ({named}{more})"

    def _verdict_text(self) -> str:
        assert self.refusal is not None
        return (
            f"saving tensors among {self.world} ranks: {self.refusal}. Nothing was "
            "published; the next save starts over"
        )[:1900]
