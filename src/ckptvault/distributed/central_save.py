"""Rank 0's part of a collective save's DCP steps (:mod:`~ckptvault.distributed.dcp_save`).

Each step is a function of what the ranks sent, already received and decoded, and
runs no collective: deciding whether the kept plan is reused
(:mod:`~ckptvault.distributed.plan_cache`), DCP's global plan and each rank's
assignment, and collecting the write results (DCP's ``finish``, the tensor table,
what each rank's index must hold). ``bench/coordinator_scale.py`` times these very
steps over the messages of up to 1,024 simulated ranks.

A step that refuses what a rank sent keeps the reason (:attr:`CentralSave.refusal`)
and answers every rank with the same error from then on, so every rank raises the
same :class:`~ckptvault.errors.SaveFailedError`.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from ckptvault.distributed.plan_cache import CentralPlan, SavePlanCache, plan_digest
from ckptvault.distributed.plan_wire import (
    announcement,
    assignment,
    check_agreement,
    plan_from_json,
)
from ckptvault.distributed.rank_index import SaveIndexes, expectation, index_chunks
from ckptvault.distributed.result_wire import (
    index_record,
    results_from_json,
    short_results_from_json,
)
from ckptvault.distributed.wire import Field, error_of
from ckptvault.errors import PeerMessageError
from ckptvault.format.layout import file_holder
from ckptvault.format.tensor_table import build_tensor_table
from ckptvault.io.planners import TensorOnlySavePlanner
from ckptvault.io.writer import VaultStorageWriter

_MAX_NAMED = 4  # failed ranks named in a verdict; the rest are counted


class CentralSave:
    """Rank 0's steps of one collective save (see the module docstring).

    ``writer``: rank 0's storage writer, which ``finish`` fills with every rank's
    metadata, file records and keys; ``planner``: rank 0's planner (DCP's global
    step runs on it); ``cache``: the plans kept between saves (None: always plan
    afresh); ``indexes``: this save's indexes (format 3; None for formats 1-2, in
    which rank 0's manifest lists every chunk and nothing is kept)."""

    def __init__(
        self,
        writer: VaultStorageWriter,
        planner: TensorOnlySavePlanner,
        world: int,
        encrypted: bool,
        cache: SavePlanCache | None,
        indexes: SaveIndexes | None,
    ) -> None:
        self.writer = writer
        self.planner = planner
        self.world = world
        self.encrypted = encrypted
        self.cache = cache if indexes is not None else None
        self.indexes = indexes
        self.refusal: str | None = None  # why the save fails, once it does
        self.reused: CentralPlan | None = None  # the kept plan, when reused
        self.digests: list[str] = []  # every rank's announced plan digest
        self.plans: list[Any] | None = None  # every rank's plan, as received
        self.central: list[SavePlan] = []  # the global plan
        self.metadata: Metadata | None = None  # DCP's global metadata

    def refuse(self, reason: str) -> None:
        """The save fails for ``reason`` (the first reason stays)."""
        self.refusal = self.refusal or reason

    def decide(self, gathered: list[Any] | None) -> dict[str, Any]:
        """Reuse the kept plan (every rank's digest unchanged, every rank holding its
        assignment), plan afresh (every rank sent its plan), or have every rank resend
        its plan; or the same error for every rank."""
        if gathered is not None and self.refusal is None:
            self.refuse_failed(gathered, "planning")
        if gathered is None or self.refusal is not None:
            return {"error": self.verdict_text()}
        try:
            announced = [announcement(raw, rank) for rank, raw in enumerate(gathered)]
        except PeerMessageError as exc:
            self.refusal = str(exc)
            return {"error": self.verdict_text()}
        self.digests = [digest for digest, _held, _plan in announced]
        if self.cache is not None:
            held = [held for _digest, held, _plan in announced]
            self.reused = self.cache.reusable(self.world, self.digests, held)
        if self.reused is not None:
            return {"step": "reuse"}
        self.plans = [plan for _digest, _held, plan in announced]
        return {"step": "plan" if all(plan is not None for plan in self.plans) else "resend"}

    def global_step(self, gathered: list[Any] | None) -> list[Any]:
        """Each rank's assignment, or the same error for every rank."""
        if gathered is not None and self.refusal is None:
            self.refuse_failed(gathered, "planning")
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
        return [{"error": self.verdict_text()}] * self.world

    def _plan_of(self, raw: Any, rank: int) -> SavePlan:
        """Rank ``rank``'s plan, which must have the digest it announced: the digest
        rank 0 keeps is the one it computed itself."""
        plan = plan_from_json(raw, rank)
        if plan_digest(raw) != self.digests[rank]:
            raise Field(rank, "a save plan").refuse("a plan of another digest than it announced")
        return plan

    def finish(self, gathered: list[Any] | None) -> dict[str, Any]:
        if gathered is not None and self.refusal is None:
            self.refuse_failed(gathered, "writing")
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
        return {"error": self.verdict_text()}

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

    def refuse_failed(self, gathered: list[Any], what: str) -> None:
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

    def verdict_text(self) -> str:
        assert self.refusal is not None
        return (
            f"saving tensors among {self.world} ranks: {self.refusal}. Nothing was "
            "published; the next save starts over"
        )[:1900]
