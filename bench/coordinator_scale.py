"""Rank 0's time per collective save at 1 to 1,024 simulated ranks: the first save
of a structure, and the saves after it (issue 27, item 4).

    python -m bench.coordinator_scale [--ranks 1 8 64 256 1024] [--repeats 3]
                                      [--layers 60] [--width 18432] [--dir /dev/shm/...]

No process group is started. The 723-parameter GPT-like model of
:mod:`bench.scale_ranks` is sharded on dim 0 over N ranks (DCP's local plans for
FSDP2 shards, built in one process). Every rank's part is simulated as the real
ranks do it, untimed: its plan and the plan's digest, its files laid out by
ckptvault's writer (no tensor bytes are written; each file gets a record with one
random digest per 4 MiB), its own index written into a real staging area (tmpfs by
default), and every message it sends encoded as the coordinator's transport
encodes it. Rank 0's part is timed, with the very code a save runs
(:class:`~ckptvault.distributed.central_save.CentralSave`,
:func:`~ckptvault.distributed.rank_index.root_indexes`):

- **receive**: decoding every message rank 0 receives (the coordinator's bounded
  JSON loader): plans or their digests, write results, every rank's part;
- **plan**: deciding whether the kept plan is reused; a fresh plan is DCP's global
  plan over every rank's plan, checked, and each rank's assignment encoded;
- **collect**: the write results: every chunk checked against the plan, DCP's
  metadata, the tensor table and what each rank's index must hold (a fresh plan),
  or each rank's files checked against the kept plan (a reused one);
- **publish**: every rank's part checked, the state composed, rank 0's index
  written and every other rank's read back and checked, the root built, encoded
  and published.

What is not simulated: the network time of the collectives, and the ranks' own
work (each does its own part in parallel with the others).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan
from torch.distributed.checkpoint.storage import WriteResult

from bench.scale_ranks import _record, gpt_model, local_plans
from ckptvault import __version__
from ckptvault.distributed import coordinator as transport
from ckptvault.distributed import messages
from ckptvault.distributed.central_save import CentralSave
from ckptvault.distributed.plan_cache import SavePlanCache, plan_digest
from ckptvault.distributed.plan_wire import assigned_plan, plan_to_json
from ckptvault.distributed.rank_index import SaveIndexes, index_chunks, root_indexes
from ckptvault.distributed.rank_index import write_rank_index as write_index
from ckptvault.distributed.result_wire import results_to_json, short_results_to_json
from ckptvault.format.layout import generation_created_at, new_generation_id, tensor_file_name
from ckptvault.format.manifest import Manifest
from ckptvault.io.planners import TensorOnlySavePlanner
from ckptvault.io.writer import (
    MIN_FILE_BYTES,
    VaultStorageWriter,
    _bucket,
    _layout,
    _results,
    files_per_rank,
)
from ckptvault.state.capture import capture_state
from ckptvault.state.ranks import compose
from ckptvault.storage.base import StagingArea
from ckptvault.storage.posix.store import PosixStore
from ckptvault.trust.digests import DEFAULT_CHUNK_SIZE

GOAL_S = 2.0  # issue 27: rank 0's time per save at 1,024 ranks, after the first save
GOAL_RANKS = 1024
WRITER_THREADS = 8  # a GPU node's writer: default_threads() is min(8, cores)
RUN_ID = "coordinator-bench"
STAGES = ("receive", "plan", "collect", "publish")


@dataclass
class SaveTimes:
    """Rank 0's seconds in one save, by stage."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    reused: bool = False

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@dataclass
class Point:
    ranks: int
    parameters: int
    files: int
    index_bytes: int
    first: SaveTimes
    later: list[SaveTimes]


class _Clock:
    def __init__(self, times: SaveTimes) -> None:
        self.times = times

    def __call__(self, stage: str, work: Any) -> Any:
        started = time.perf_counter()
        result = work()
        self.times.seconds[stage] += time.perf_counter() - started
        return result


def _sent(value: Any) -> bytes:
    """What a rank puts on the wire (its own work: untimed)."""
    return transport._encode(value)


def _received(frames: list[bytes], what: str) -> list[Any]:
    """What rank 0 makes of the frames of a gather (timed by the caller)."""
    return [
        transport._checked(
            transport._decode(torch.frombuffer(bytearray(frame), dtype=torch.uint8), rank, what),
            rank,
        )
        for rank, frame in enumerate(frames)
    ]


class SimulatedJob:
    """N simulated ranks saving one model into one store, and rank 0's kept plan."""

    def __init__(self, model: torch.nn.Module, ranks: int, root: Path) -> None:
        self.ranks = ranks
        self.captured = capture_state({"model": model})
        self.plans: list[SavePlan] = local_plans(self.captured.tensors, ranks)
        self.messages = [plan_to_json(plan) for plan in self.plans]
        self.digests = [plan_digest(message) for message in self.messages]
        self.assignments: list[Any] = []  # each rank's kept assignment
        self.cache = SavePlanCache()
        self.store = PosixStore(root)
        self.store.acquire_writer()
        self.threads = files_per_rank(WRITER_THREADS, ranks)
        self.step = 0
        self.files = 0
        self.index_bytes = 0

    def save(self) -> SaveTimes:
        """One collective save, rank 0's stages timed."""
        self.step += 1
        reuse = bool(self.assignments)
        times = SaveTimes(reused=reuse)
        clock = _Clock(times)
        generation_id = new_generation_id()
        area = self.store.begin_generation(generation_id)
        try:
            indexes = SaveIndexes(RUN_ID, generation_id)
            writer = VaultStorageWriter(area, DEFAULT_CHUNK_SIZE, self.threads, None, 0)
            central = CentralSave(
                writer, TensorOnlySavePlanner(), self.ranks, False, self.cache, indexes
            )
            self._plan(central, clock, reuse)
            self._write(central, clock, area, indexes, generation_id, reuse)
            self._publish(central, clock, area, indexes, generation_id)
        except BaseException:
            area.abort()
            raise
        self.cache.commit()
        return times

    # -- the steps -----------------------------------------------------------------------

    def _plan(self, central: CentralSave, clock: _Clock, reuse: bool) -> None:
        frames = [
            _sent({"digest": d, "held": reuse, "plan": None if reuse else m})
            for d, m in zip(self.digests, self.messages, strict=True)
        ]
        gathered = clock("receive", lambda: _received(frames, "a gather"))
        decision = clock("plan", lambda: central.decide(gathered))
        assert decision == {"step": "reuse" if reuse else "plan"}, decision
        if reuse:
            return
        encoded = clock("plan", lambda: [_sent(a) for a in central.global_step(central.plans)])
        assert central.refusal is None, central.refusal
        self.assignments = [json.loads(frame) for frame in encoded]

    def _write(
        self,
        central: CentralSave,
        clock: _Clock,
        area: StagingArea,
        indexes: SaveIndexes,
        generation_id: str,
        reuse: bool,
    ) -> None:
        """Every rank writes (untimed), then rank 0 collects the results."""
        frames = []
        self.files = self.index_bytes = 0
        for rank in range(self.ranks):
            plan = assigned_plan(self.plans[rank], self.assignments[rank])
            results = self._laid_out(rank, plan)
            records = {
                r.storage_data.location.file: r.storage_data.file_record
                for r in results
                if r.storage_data.file_record is not None
            }
            self.files += len(records)
            chunks = index_chunks(plan.items, results)
            index = None
            if rank == 0:
                indexes.own_records, indexes.own_chunks = records, chunks
            elif records:
                _name, record = write_index(area, RUN_ID, generation_id, rank, records, chunks)
                self.index_bytes += record.size
                index = record.to_json()
            written = short_results_to_json(results) if reuse else results_to_json(results)
            frames.append(_sent({"written": written, "index": index}))
        gathered = clock("receive", lambda: _received(frames, "a gather"))
        verdict = clock("collect", lambda: central.finish(gathered))
        assert verdict == {"ok": True}, verdict

    def _laid_out(self, rank: int, plan: SavePlan) -> list[WriteResult]:
        """What ckptvault's writer returns for ``plan`` (VaultStorageWriter.write_data's
        layout), with file records of random digests instead of written bytes."""
        items = list(plan.items)
        total = sum(item.tensor_storage_size() or 0 for item in items)
        files = max(1, min(self.threads, len(items), -(-total // MIN_FILE_BYTES)))
        results: list[WriteResult] = []
        for index, bucket in enumerate(_bucket(items, files)):
            ordered, header = _layout(bucket)
            size = header.data_start + sum(entry.nbytes for entry in header.entries.values())
            name = tensor_file_name(rank, index)
            results += _results(name, ordered, header, _record(size), None)
        return results

    def _publish(
        self,
        central: CentralSave,
        clock: _Clock,
        area: StagingArea,
        indexes: SaveIndexes,
        generation_id: str,
    ) -> None:
        writer = central.writer
        own_files: dict[int, list[str]] = {rank: [] for rank in range(self.ranks)}
        for name in writer.file_records:
            own_files[int(name[1:6])].append(name)
        frames = [
            _sent(
                {
                    "tree": {},
                    "files": files + ([f"r{rank:05d}-index.json"] if rank and files else []),
                }
            )
            for rank, files in own_files.items()
        ]

        def publish() -> None:
            parts = _received(frames, "an all-gather")
            ranks = [messages.rank_part(raw, rank, self.ranks) for rank, raw in enumerate(parts)]
            area.adopt([name for entry in ranks[1:] for name in entry["files"]])
            state = compose(self.captured.tree, [entry["tree"] for entry in ranks])
            listed = root_indexes(
                area, indexes, indexes.own_records, writer.file_records, DEFAULT_CHUNK_SIZE
            )
            manifest = Manifest(
                run_id=RUN_ID,
                step=self.step,
                generation_id=generation_id,
                created_at=generation_created_at(generation_id),
                parent=None,
                chunk_size=DEFAULT_CHUNK_SIZE,
                files=writer.file_records,
                dcp=writer.dcp_json or {},
                state=state,
                contract={"user": {"config": {"layers": 60}}, "torch": torch.__version__},
                writer={"ckptvault": __version__, "world_size": self.ranks},
                indexes=listed,
                tensor_table=indexes.table,
            )
            area.publish(self.step, manifest.to_bytes())

        clock("publish", publish)


def measure(ranks: int, model: torch.nn.Module, repeats: int, root: Path) -> Point:
    """The first save of ``ranks`` simulated ranks and ``repeats`` saves after it."""
    store = root / f"ranks-{ranks}"
    job = SimulatedJob(model, ranks, store)
    try:
        first = job.save()
        later = [job.save() for _ in range(repeats)]
        assert not first.reused and all(t.reused for t in later)
        return Point(ranks, len(job.captured.tensors), job.files, job.index_bytes, first, later)
    finally:
        job.store.release_writer()
        shutil.rmtree(store, ignore_errors=True)


def table(points: list[Point]) -> list[str]:
    """The Markdown table: rank 0's seconds per save, first and later, with the goal."""
    lines = [
        "| ranks | files | indexes (MB) | first save s (plan / collect / publish) | later saves s, "
        "best (median) | later: receive / plan / collect / publish | goal |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in points:
        f = p.first.seconds
        totals = [t.total for t in p.later]
        best = min(p.later, key=lambda t: t.total).seconds
        goal = ""
        if p.ranks == GOAL_RANKS:
            met = min(totals) <= GOAL_S
            goal = f"<= {GOAL_S:g} s: **{'met' if met else 'not met'}**"
        lines.append(
            f"| {p.ranks:,} | {p.files:,} | {p.index_bytes / 1e6:.1f} | {p.first.total:.3f} "
            f"({f['plan']:.2f} / {f['collect']:.2f} / {f['publish']:.2f}) | {min(totals):.3f} "
            f"({statistics.median(totals):.3f}) | {best['receive']:.3f} / {best['plan']:.3f} / "
            f"{best['collect']:.3f} / {best['publish']:.3f} | {goal} |"
        )
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=3, help="saves after the first")
    parser.add_argument("--layers", type=int, default=60, help="60: 723 parameters")
    parser.add_argument("--width", type=int, default=18432)
    default_dir = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path("bench-out")
    parser.add_argument("--dir", type=Path, default=default_dir / f"ckptvault-coord-{os.getpid()}")
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    model = gpt_model(layers=args.layers, width=args.width)
    points = []
    try:
        for ranks in args.ranks:
            started = time.perf_counter()
            points.append(measure(ranks, model, args.repeats, args.dir))
            print(f"{ranks:,} ranks: {time.perf_counter() - started:.0f} s", flush=True)
    finally:
        shutil.rmtree(args.dir, ignore_errors=True)
    text = "\n".join(
        [
            f"Rank 0's seconds per collective save, {points[0].parameters} parameters sharded "
            f"on dim 0 over N simulated ranks (staging on {args.dir.parent}; {os.cpu_count()} "
            f"cores, torch {torch.__version__}):",
            "",
            *table(points),
        ]
    )
    print("\n" + text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "coordinator_scale.md").write_text(text + "\n")
    (args.out / "coordinator_scale.json").write_text(
        json.dumps([asdict(p) for p in points], indent=1)
    )
    return text


if __name__ == "__main__":
    main()
