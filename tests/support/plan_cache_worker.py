"""One rank of a job that saves through the kept plan and rank-written indexes
(launched by ``multirank.launch`` with ``worker=``; ``test_plan_cache.py`` checks it).

``python plan_cache_worker.py SCENARIO STORE OUT``:

- ``structures``: saves whose structure stays or changes (a shape, a dtype, a tensor
  added or removed, one rank's own tensor), recording whether each reused the plan,
  then restores some of them and compares every tensor;
- ``hostile``: rank 1 misbehaves in one save after another — its index is not what
  it announced, its index lists other chunks or chunk digests than it wrote (announced
  honestly), it claims an unchanged plan while its own tensor changed — and each save
  must fail on both ranks with nothing published; then clean saves go on.

Writes ``OUT/rank<r>.json``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import ckptvault as cv
from ckptvault.distributed import dcp_save
from support.dcp_worker import run_scenario
from support.rank_worker import COLS, RANK, WORLD, full_of, manager, sharded

# Each step's structure: (rows of the sharded weight, the bias dtype, an extra tensor,
# the length of the last rank's own tensor (every other rank's has 2)).
STRUCTURES = {
    1: (10, torch.float32, False, 2),
    2: (10, torch.float32, False, 2),  # unchanged: reused
    3: (12, torch.float32, False, 2),  # a shape
    4: (12, torch.float32, False, 2),
    5: (12, torch.float64, False, 2),  # a dtype
    6: (12, torch.float64, True, 2),  # a tensor added
    7: (12, torch.float64, False, 2),  # and removed
    8: (12, torch.float64, False, 5),  # one rank's own tensor
    9: (12, torch.float64, False, 5),
}
RESTORED = (2, 4, 7, 9)


def expected(step: int) -> dict[str, torch.Tensor]:
    """Every tensor of ``step``'s state, whole (what this rank restores)."""
    rows, dtype, extra, mine = STRUCTURES[step]
    tensors = {
        "w": torch.arange(rows * COLS, dtype=torch.float32).reshape(rows, COLS) * step,
        "b": torch.full((3,), step + 0.25, dtype=dtype),
    }
    if extra:
        tensors["extra"] = torch.full((2,), -float(step))
    length = mine if RANK == WORLD - 1 else 2
    tensors["mine"] = torch.arange(length, dtype=torch.float32) + step + RANK
    return tensors


def state(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The job's model (the weight sharded) and this rank's own tensor (PerRank)."""
    model = {name: sharded(t) if name == "w" else t.clone() for name, t in tensors.items()}
    own = {"t": model.pop("mine")} if "mine" in model else {}
    return {"model": model, "mine": cv.PerRank(own)}


def restored(live: dict[str, Any], name: str) -> torch.Tensor:
    if name == "mine":
        return live["mine"].value["t"]
    return full_of(live["model"][name])


def structures(store: str, out: dict[str, Any]) -> None:
    reused = []
    with manager(store) as mgr:
        for step in STRUCTURES:
            before = mgr.stats.plans_reused
            mgr.save(step, state(expected(step)))
            reused.append(mgr.stats.plans_reused - before)
        exact = {}
        for step in RESTORED:
            live = state({k: torch.zeros_like(v) for k, v in expected(step).items()})
            info = mgr.restore(live, step=step)
            assert info is not None and info.step == step
            exact[step] = all(
                torch.equal(restored(live, name), value)
                and restored(live, name).dtype == value.dtype
                for name, value in expected(step).items()
            )
    out.update(reused=reused, exact=exact)


def attempt(mgr: cv.CheckpointManager, step: int, tensors: dict[str, torch.Tensor]) -> Any:
    """Save ``step``; the error it raised (type, message) or None."""
    try:
        mgr.save(step, state(tensors))
    except cv.errors.CheckpointError as exc:
        return [type(exc).__name__, str(exc)]
    return None


def lying_index(kind: str) -> Any:
    """Rank 1's index writer, misbehaving as ``kind`` says."""
    original = dcp_save.write_rank_index

    def write(area: Any, run_id: str, generation_id: str, holder: int, records: Any, chunks: Any):
        if kind == "other bytes":  # written, then changed behind the announced digest
            name, record = original(area, run_id, generation_id, holder, records, chunks)
            path = Path(area.location) / name
            data = bytearray(path.read_bytes())
            data[len(data) // 2] ^= 1
            path.chmod(0o644)
            path.write_bytes(bytes(data))
            return name, record
        if kind == "other chunks":  # a chunk placed elsewhere, announced honestly
            first = next(iter(chunks.values()))[0]
            first["start"] += 4
        if kind == "other digests":  # a chunk digest that is not the file's
            name = next(iter(records))
            record = records[name]
            records = {**records, name: type(record)(record.size, record.blake3, ("0" * 64,))}
        return original(area, run_id, generation_id, holder, records, chunks)

    return write


def hostile(store: str, out: dict[str, Any]) -> None:
    base = {"w": torch.ones(10, COLS), "b": torch.zeros(3)}
    mine = {**base, "mine": torch.ones(4)}
    results: dict[str, Any] = {}
    with manager(store) as mgr:
        assert attempt(mgr, 1, mine) is None
        step = 1
        original = dcp_save.write_rank_index
        for kind in ("other bytes", "other chunks", "other digests"):
            step += 1
            if RANK == 1:
                dcp_save.write_rank_index = lying_index(kind)  # type: ignore[assignment]
            results[kind] = attempt(mgr, step, mine)
            dcp_save.write_rank_index = original  # type: ignore[assignment]
            results[kind + " published"] = [g.step for g in mgr.generations()]
        # Rank 1 claims its plan is unchanged (the digest of the last plan it made),
        # while its own tensor grew: rank 0 reuses the kept plan.
        digest = dcp_save.plan_digest
        made: list[str] = []

        def recorded(message: Any) -> str:
            made.append(digest(message))
            return made[-1]

        if RANK == 1:
            dcp_save.plan_digest = recorded  # type: ignore[assignment]
        assert attempt(mgr, 10, mine) is None  # plans afresh after the failures
        assert attempt(mgr, 11, mine) is None  # and reuses it
        if RANK == 1:
            dcp_save.plan_digest = lambda message: made[-1]  # type: ignore[assignment]
        grown = {**base, "mine": torch.ones(6 if RANK == 1 else 4)}
        results["stale digest"] = attempt(mgr, 12, grown)
        results["stale digest published"] = [g.step for g in mgr.generations()]
        # Still lying, rank 1 now sends its plan (it holds no assignment after the
        # failure): its digest is not its plan's.
        results["lying plan"] = attempt(mgr, 13, grown)
        dcp_save.plan_digest = digest  # type: ignore[assignment]
        results["clean"] = attempt(mgr, 14, grown)
        results["reused"] = (mgr.stats.plans_reused, attempt(mgr, 15, grown))
        results["reused after"] = mgr.stats.plans_reused
        live = state({k: torch.zeros_like(v) for k, v in grown.items()})
        info = mgr.restore(live)
        assert info is not None
        results["restored"] = info.step
        results["exact"] = all(torch.equal(restored(live, k), v) for k, v in grown.items())
    out.update(results)


SCENARIOS = {"structures": structures, "hostile": hostile}


if __name__ == "__main__":
    run_scenario(SCENARIOS)
