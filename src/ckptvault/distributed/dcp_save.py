"""DCP's save steps across ranks, with ckptvault's collectives instead of DCP's.

``dcp.save`` on a process group carries plans and write results between ranks with
``gather_object`` / ``scatter_object_list`` / ``broadcast_object_list``: pickle.
Rank 0 — the rank that signs and publishes — would unpickle whatever another rank
sent, and run it. So ckptvault drives DCP's planner and its own storage writer
itself, in the order ``torch.distributed.checkpoint.state_dict_saver`` does, and
carries what crosses ranks as bounded JSON over the coordinator's gloo group
(:mod:`~ckptvault.distributed.plan_wire`, :mod:`~ckptvault.distributed.result_wire`):

1. every rank: ``set_up_planner``, ``set_up_storage_writer``, ``create_local_plan``,
   ``prepare_local_plan``; the plan's digest is **gathered** to rank 0, which
   **broadcasts** whether it reuses the plan it made for the same digests
   (:mod:`~ckptvault.distributed.plan_cache`);
2. a plan made afresh: every rank's plan is **gathered** to rank 0, which runs
   ``create_global_plan`` (dedup: a replicated tensor written once) and
   ``prepare_global_plan``; each rank's part is **scattered** back as the positions
   of its own items to write. A reused plan: each rank writes the part it kept;
3. every rank: ``finish_plan``, ``write_data`` and (format 3) its own index
   (:mod:`~ckptvault.distributed.rank_index`; rank 0 writes its own at publish);
   its write results are **gathered**: in full for a fresh plan, each file's size
   and digest for a reused one;
4. rank 0: ``finish`` (every rank's chunk locations, file records, wrapped keys) and
   what each rank's index must hold, or, with a reused plan, each rank's files
   checked against the plan's; the verdict is **broadcast**, and every rank returns
   or raises it.

Every rank takes part in every collective whatever happens: a step that fails
(an I/O error, a refused message) becomes an error message in the next one, so no
rank is left waiting in a collective the others skipped, and every rank raises the
same :class:`~ckptvault.errors.SaveFailedError` naming the rank. Only a collective
that itself fails (a rank died: :class:`~ckptvault.errors.CollectiveError`) ends the
save at once. DCP's own plan cache is not used here: DCP keeps it per process,
keyed by nothing ranks agree on; ckptvault's (:mod:`~ckptvault.distributed.plan_cache`)
is agreed on through rank 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ckptvault.coordinator import Coordinator
from ckptvault.distributed.central_save import CentralSave
from ckptvault.distributed.plan_cache import RankPlan, SavePlanCache, plan_digest
from ckptvault.distributed.plan_wire import assigned_plan, plan_to_json
from ckptvault.distributed.rank_index import SaveIndexes, index_chunks, write_rank_index
from ckptvault.distributed.result_wire import results_to_json, short_results_to_json
from ckptvault.distributed.wire import Field, error_message, error_of
from ckptvault.errors import PeerMessageError, SaveFailedError
from ckptvault.io.planners import TensorOnlySavePlanner
from ckptvault.io.writer import VaultStorageWriter
from ckptvault.storage.base import StagingArea
from ckptvault.trust.envelope import FileEncryption

T = TypeVar("T")
_STEPS = ("reuse", "plan", "resend")  # rank 0's decisions after the plans' digests


def write_tensors_together(
    tensors: dict[str, torch.Tensor],
    staging: StagingArea,
    chunk_size: int,
    threads: int,
    encryption: FileEncryption | None,
    coordinator: Coordinator,
    cache: SavePlanCache | None = None,
    indexes: SaveIndexes | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> VaultStorageWriter:
    """Write this rank's part of ``tensors`` (every rank calls it, collectively) into
    ``staging``, DCP's planner deciding who writes what. Returns the writer: on rank 0
    it holds every rank's DCP metadata (with a reused plan: its version alone), file
    records and wrapped keys. ``cache``: the plans kept between this writer's saves
    (the caller commits or forgets what this save staged in it, once every rank
    knows the save's outcome). ``indexes`` (format 3): every rank but 0 writes its
    index, and what the save learns of the indexes is kept there. ``on_bytes``: told
    each piece of this rank's bytes written. Raises the same SaveFailedError on every
    rank when any rank failed."""
    writer = VaultStorageWriter(
        staging,
        chunk_size=chunk_size,
        threads=threads,
        encryption=encryption,
        rank=coordinator.rank,
        on_bytes=on_bytes,
    )
    _SaveSteps(writer, coordinator, encryption is not None, cache, indexes).run(tensors)
    if writer.dcp_json is None:  # ranks other than 0: the metadata is rank 0's
        writer.dcp_json = {"version": None, "tensors": {}}
    return writer


class _SaveSteps:
    """One collective save through DCP's planner (see the module docstring); rank 0's
    steps are :class:`~ckptvault.distributed.central_save.CentralSave`'s."""

    def __init__(
        self,
        writer: VaultStorageWriter,
        coordinator: Coordinator,
        encrypted: bool,
        cache: SavePlanCache | None,
        indexes: SaveIndexes | None,
    ):
        self.writer = writer
        self.coordinator = coordinator
        # Without indexes written by the ranks (formats 1-2) nothing is kept: rank 0
        # needs every chunk for the manifest itself.
        self.cache = cache if indexes is not None else None
        self.indexes = indexes
        self.planner = TensorOnlySavePlanner()
        self.failure: BaseException | None = None  # this rank's own, raised as the cause
        self.central = (
            CentralSave(
                writer, self.planner, coordinator.world_size, encrypted, self.cache, indexes
            )
            if coordinator.is_coordinator
            else None
        )

    def run(self, tensors: dict[str, torch.Tensor]) -> None:
        central = self.central  # rank 0 only
        local = self._attempt(lambda: self._local_plan(tensors))
        announced = self._gather(self._announcement(local), "its plan")
        decision = central.decide(announced) if central else {}
        step = self._decision(self.coordinator.broadcast(decision))
        assert local is not None  # a rank without a plan made the decision an error
        plan, message, digest = local
        if step == "reuse":
            received = self._kept_assignment(digest)
        else:
            plans = central.plans if central else None
            if step == "resend":  # a rank's plan changed: rank 0 needs every one
                plans = self._gather(message, "its plan")
            received = self._scatter(central.global_step(plans) if central else None)
            if received is not None and self.cache is not None:
                self.cache.stage_rank(RankPlan(digest, received))
        results = None
        if received is not None:
            results = self._attempt(lambda: self._write(plan, received, step == "reuse"))
        sent = results if results is not None else error_message(self._failure())
        written = self._gather(sent, "its write results")
        verdict = self.coordinator.broadcast(central.finish(written) if central else {})
        error = error_of(verdict, Field(0, "a save verdict"))
        if error is not None:
            raise SaveFailedError(error) from self.failure
        Field(0, "a save verdict").mapping(verdict, ("ok",), "the verdict")
        self.writer.reused_plan = step == "reuse"

    # -- every rank ----------------------------------------------------------------------

    def _local_plan(self, tensors: dict[str, torch.Tensor]) -> tuple[SavePlan, Any, str]:
        """This rank's local plan, the message that carries it and its digest."""
        is_coordinator = self.coordinator.is_coordinator
        # VaultStorageWriter.storage_meta() is None: the manifest, not DCP, says
        # where the checkpoint is.
        self.planner.set_up_planner(
            state_dict=tensors, storage_meta=None, is_coordinator=is_coordinator
        )
        self.writer.set_up_storage_writer(
            is_coordinator, rank=self.coordinator.rank, use_collectives=True
        )
        plan = self.writer.prepare_local_plan(self.planner.create_local_plan())
        message = plan_to_json(plan)
        return plan, message, plan_digest(message)

    def _announcement(self, local: tuple[SavePlan, Any, str] | None) -> dict[str, Any]:
        """This rank's plan digest, whether it holds rank 0's assignment for it, and
        (when it does not: rank 0 will plan) the plan itself."""
        if local is None:
            return error_message(self._failure())
        _plan, message, digest = local
        held = self.cache is not None and self.cache.holds(digest)
        return {"digest": digest, "held": held, "plan": None if held else message}

    def _decision(self, decision: Any) -> str:
        """What rank 0 decided: ``reuse`` the kept plan, ``plan`` afresh from the plans
        it received, or have every rank ``resend`` its plan; its refusal raises on
        every rank."""
        field = Field(0, "a planning decision")
        error = error_of(decision, field)
        if error is not None:
            raise SaveFailedError(error) from self.failure
        step = field.mapping(decision, ("step",), "the decision")["step"]
        field.choice(step, "the step", _STEPS)
        if step == "reuse" and self.cache is None:
            raise field.refuse("a reused plan where this rank keeps none")
        return str(step)

    def _kept_assignment(self, digest: str) -> Any:
        """This rank's part of the reused plan (the assignment it kept for ``digest``),
        or None with the error kept to send."""
        assert self.cache is not None  # _decision refuses a reuse without one
        if self.cache.rank is None or not self.cache.holds(digest):
            self.failure = SaveFailedError(
                f"rank {self.coordinator.rank}: rank 0 reused a plan this rank holds no "
                "assignment for"
            )
            return None
        return self.cache.rank.assignment

    def _write(self, local: SavePlan, received: Any, reuse: bool) -> dict[str, Any]:
        plan = self.planner.finish_plan(assigned_plan(local, received))
        future = self.writer.write_data(plan, self.planner)
        future.wait()
        results: list[WriteResult] = future.value()
        index = self._own_index(plan, results) if self.indexes is not None else None
        written = short_results_to_json(results) if reuse else results_to_json(results)
        return {"written": written, "index": index}

    def _own_index(self, plan: SavePlan, results: list[WriteResult]) -> dict[str, Any] | None:
        """Keep this rank's files and chunks for its index and (ranks other than 0,
        when it wrote a file) write it: its record, to announce."""
        indexes = self.indexes
        assert indexes is not None
        indexes.own_chunks = index_chunks(plan.items, results)
        indexes.own_records = {
            result.storage_data.location.file: result.storage_data.file_record
            for result in results
            if result.storage_data.file_record is not None
        }
        rank = self.coordinator.rank
        if rank == 0 or not indexes.own_records:  # rank 0's covers its state file too
            return None
        name, record = write_rank_index(
            self.writer.staging,
            indexes.run_id,
            indexes.generation_id,
            rank,
            indexes.own_records,
            indexes.own_chunks,
        )
        self.writer.own_files.append(name)
        return record.to_json()

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
            assert self.central is not None
            self.central.refuse(f"rank 0 refused what a rank sent as {what}: {exc}")
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
