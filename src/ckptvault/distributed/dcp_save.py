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
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from ckptvault.coordinator import Coordinator
from ckptvault.distributed.plan_cache import CentralPlan, RankPlan, SavePlanCache, plan_digest
from ckptvault.distributed.plan_wire import (
    announcement,
    assigned_plan,
    assignment,
    check_agreement,
    plan_from_json,
    plan_to_json,
)
from ckptvault.distributed.rank_index import (
    SaveIndexes,
    expectation,
    index_chunks,
    write_rank_index,
)
from ckptvault.distributed.result_wire import (
    index_record,
    results_from_json,
    results_to_json,
    short_results_from_json,
    short_results_to_json,
)
from ckptvault.distributed.wire import Field, error_message, error_of
from ckptvault.errors import PeerMessageError, SaveFailedError
from ckptvault.format.layout import file_holder
from ckptvault.format.tensor_table import build_tensor_table
from ckptvault.io.planners import TensorOnlySavePlanner
from ckptvault.io.writer import VaultStorageWriter
from ckptvault.storage.base import StagingArea
from ckptvault.trust.envelope import FileEncryption

T = TypeVar("T")
_MAX_NAMED = 4  # failed ranks named in a verdict; the rest are counted
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
) -> VaultStorageWriter:
    """Write this rank's part of ``tensors`` (every rank calls it, collectively) into
    ``staging``, DCP's planner deciding who writes what. Returns the writer: on rank 0
    it holds every rank's DCP metadata (with a reused plan: its version alone), file
    records and wrapped keys. ``cache``: the plans kept between this writer's saves
    (the caller commits or forgets what this save staged in it, once every rank
    knows the save's outcome). ``indexes`` (format 3): every rank but 0 writes its
    index, and what the save learns of the indexes is kept there. Raises the same
    SaveFailedError on every rank when any rank failed."""
    writer = VaultStorageWriter(
        staging,
        chunk_size=chunk_size,
        threads=threads,
        encryption=encryption,
        rank=coordinator.rank,
    )
    _SaveSteps(writer, coordinator, encryption is not None, cache, indexes).run(tensors)
    if writer.dcp_json is None:  # ranks other than 0: the metadata is rank 0's
        writer.dcp_json = {"version": None, "tensors": {}}
    return writer


class _SaveSteps:
    """One collective save through DCP's planner (see the module docstring)."""

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
        self.encrypted = encrypted
        # Without indexes written by the ranks (formats 1-2) nothing is kept: rank 0
        # needs every chunk for the manifest itself.
        self.cache = cache if indexes is not None else None
        self.indexes = indexes
        self.planner = TensorOnlySavePlanner()
        self.world = coordinator.world_size
        self.failure: BaseException | None = None  # this rank's own, raised as the cause
        self.refusal: str | None = None  # rank 0: why the save fails, once it does
        self.reused: CentralPlan | None = None  # rank 0: the kept plan, when reused
        self.digests: list[str] = []  # rank 0: every rank's announced plan digest
        self.plans: list[Any] | None = None  # rank 0: every rank's plan, as received
        self.central: list[SavePlan] = []  # rank 0: the global plan
        self.metadata: Metadata | None = None  # rank 0: DCP's global metadata

    def run(self, tensors: dict[str, torch.Tensor]) -> None:
        local = self._attempt(lambda: self._local_plan(tensors))
        announced = self._gather(self._announcement(local), "its plan")
        decision = self._decide(announced) if self.coordinator.is_coordinator else {}
        step = self._decision(self.coordinator.broadcast(decision))
        assert local is not None  # a rank without a plan made the decision an error
        plan, message, digest = local
        if step == "reuse":
            received = self._kept_assignment(digest)
        else:
            if step == "resend":  # a rank's plan changed: rank 0 needs every one
                self.plans = self._gather(message, "its plan")
            assignments = self._global_step(self.plans) if self.coordinator.is_coordinator else None
            received = self._scatter(assignments)
            if received is not None and self.cache is not None:
                self.cache.stage_rank(RankPlan(digest, received))
        results = None
        if received is not None:
            results = self._attempt(lambda: self._write(plan, received, step == "reuse"))
        sent = results if results is not None else error_message(self._failure())
        written = self._gather(sent, "its write results")
        verdict = self._finish(written) if self.coordinator.is_coordinator else {}
        verdict = self.coordinator.broadcast(verdict)
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

    def _decide(self, gathered: list[Any] | None) -> dict[str, Any]:
        """Reuse the kept plan (every rank's digest unchanged, every rank holding its
        assignment), plan afresh (every rank sent its plan), or have every rank resend
        its plan; or the same error for every rank."""
        if gathered is not None and self.refusal is None:
            self._refuse_failed(gathered, "planning")
        if gathered is None or self.refusal is not None:
            return {"error": self._verdict_text()}
        try:
            announced = [announcement(raw, rank) for rank, raw in enumerate(gathered)]
        except PeerMessageError as exc:
            self.refusal = str(exc)
            return {"error": self._verdict_text()}
        self.digests = [digest for digest, _held, _plan in announced]
        if self.cache is not None:
            held = [held for _digest, held, _plan in announced]
            self.reused = self.cache.reusable(self.world, self.digests, held)
        if self.reused is not None:
            return {"step": "reuse"}
        self.plans = [plan for _digest, _held, plan in announced]
        return {"step": "plan" if all(plan is not None for plan in self.plans) else "resend"}

    def _global_step(self, gathered: list[Any] | None) -> list[Any]:
        """Each rank's assignment, or the same error for every rank."""
        if gathered is not None and self.refusal is None:
            self._refuse_failed(gathered, "planning")
        if gathered is not None and self.refusal is None:
            try:
                plans = [self._plan_of(raw, rank) for rank, raw in enumerate(gathered)]
                check_agreement(plans)
                central, self.metadata = self.planner.create_global_plan(plans)
                self.central = self.writer.prepare_global_plan(central)
                return [
                    assignment(plans[rank], self.central[rank], rank) for rank in range(self.world)
                ]
            except Exception as exc:  # a refused plan, or DCP's own checks (ValueError ...)
                self.refusal = f"planning failed: {type(exc).__name__}: {exc}"
        return [{"error": self._verdict_text()}] * self.world

    def _plan_of(self, raw: Any, rank: int) -> SavePlan:
        """Rank ``rank``'s plan, which must have the digest it announced: the digest
        rank 0 keeps is the one it computed itself."""
        plan = plan_from_json(raw, rank)
        if plan_digest(raw) != self.digests[rank]:
            raise Field(rank, "a save plan").refuse("a plan of another digest than it announced")
        return plan

    def _finish(self, gathered: list[Any] | None) -> dict[str, Any]:
        if gathered is not None and self.refusal is None:
            self._refuse_failed(gathered, "writing")
        if gathered is not None and self.refusal is None:
            try:
                sent = [
                    Field(rank, "write results").mapping(raw, ("written", "index"), "the results")
                    for rank, raw in enumerate(gathered)
                ]
                if self.reused is not None:
                    self._collect_known(sent, self.reused)
                else:
                    self._collect(sent)
                return {"ok": True}
            except Exception as exc:
                self.refusal = f"collecting write results failed: {type(exc).__name__}: {exc}"
        return {"error": self._verdict_text()}

    def _collect(self, sent: list[dict[str, Any]]) -> None:
        """A fresh plan: every rank's chunks checked against it, DCP's metadata, and
        (format 3) the tensor table and what each rank's index must hold."""
        results = [
            results_from_json(
                message["written"], rank, self.central[rank], self.world, self.encrypted
            )
            for rank, message in enumerate(sent)
        ]
        assert self.metadata is not None
        self.writer.finish(metadata=self.metadata, results=results)
        indexes = self.indexes
        if indexes is None:  # formats 1-2: rank 0's manifest lists every chunk
            for rank, message in enumerate(sent):
                index_record(message["index"], rank, writes_files=False)
            return
        for rank, (message, written) in enumerate(zip(sent, results, strict=True)):
            files = {
                result.storage_data.location.file: result.storage_data.file_record.size
                for result in written
                if result.storage_data.file_record is not None
            }
            record = index_record(message["index"], rank, writes_files=bool(files))
            if record is not None:
                indexes.announced[rank] = record
            if files:
                chunks = index_chunks(self.central[rank].items, written)
                indexes.expectations[rank] = expectation(rank, files, chunks)
        assert self.writer.dcp_json is not None  # finish() made it
        indexes.table = build_tensor_table(
            self.writer.dcp_json["tensors"], lambda name: file_holder(name) or 0
        )
        if self.cache is not None:
            self.cache.stage_central(
                CentralPlan(
                    self.world,
                    tuple(self.digests),
                    indexes.table,
                    self.writer.dcp_json.get("version"),
                    dict(indexes.expectations),
                )
            )

    def _collect_known(self, sent: list[dict[str, Any]], central: CentralPlan) -> None:
        """A reused plan: each rank's files must be the ones the plan made (names and
        sizes); their digests and keys are this save's, the rest is kept."""
        indexes = self.indexes
        assert indexes is not None  # a plan is kept only with rank-written indexes
        for rank, message in enumerate(sent):
            plan = central.expectations.get(rank)
            files = plan.files if plan is not None else {}
            records, keys = short_results_from_json(message["written"], rank, files, self.encrypted)
            self.writer.file_records.update(records)
            self.writer.wrapped_keys.update(keys)
            record = index_record(message["index"], rank, writes_files=bool(files))
            if record is not None:
                indexes.announced[rank] = record
        indexes.expectations = dict(central.expectations)
        indexes.table = central.table
        self.writer.dcp_json = {"version": central.dcp_version, "tensors": {}}

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
