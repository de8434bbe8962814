"""FSDP1 and FSDP2 through Accelerate's ``Checkpointer``, on 2 real gloo ranks.

Each engine trains a small model with dropout, an LR scheduler and a seedable
sampler: a reference run, and a run SIGKILLed right after its save at step 3 whose
resume in new processes must hold exactly the saved weights and optimizer state and
end bit-identical to the reference. The generation then restores at 3 ranks and at
1 (resharded: the same whole tensors), and one saved under FSDP1 restores under
FSDP2. Accelerate enables FSDP only on accelerator devices; the worker turns it on
for CPU ranks (``engine_worker.fsdp_on_cpu``), everything else is real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from support.multirank import launch
from support.readme_runs import pickled_files

WORKER = Path(__file__).parents[1] / "support" / "engine_worker.py"
ENGINES = ["fsdp2", "fsdp1", "fsdp1-FULL_STATE_DICT"]


def _run(scenario: str, store: Path, world: int, out: Path) -> tuple[list[int], list[Any]]:
    return launch(scenario, store, world, out, timeout=240, worker=WORKER)


def _ok(codes: list[int], reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    assert codes == [0] * len(codes), [report["log"][-2000:] for report in reports]
    return reports


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per engine: the reference run's reports, and the store of a run killed after
    its save at step 3."""
    root = tmp_path_factory.mktemp("fsdp")
    runs: dict[str, Any] = {}
    for engine in ENGINES:
        reference = _ok(
            *_run(f"accelerate:{engine}:reference", root / engine / "ref", 2, root / engine / "r")
        )
        codes, _ = _run(
            f"accelerate:{engine}:crash", root / engine / "store", 2, root / engine / "c"
        )
        assert codes == [-9, -9]  # SIGKILLed, no cleanup
        runs[engine] = {"reference": reference, "store": root / engine / "store", "root": root}
    return runs


@pytest.mark.parametrize("engine", ENGINES)
def test_a_run_killed_after_a_save_resumes_bit_identically(crashed: dict, engine: str):
    run = crashed[engine]
    resumed = _ok(
        *_run(f"accelerate:{engine}:resume", run["store"], 2, run["root"] / engine / "go")
    )
    for rank, (ref, res) in enumerate(zip(run["reference"], resumed, strict=True)):
        assert res["engine"] == "DistributedType.FSDP", rank
        assert res["restored"] == ref["saved"], rank  # every weight and moment, whole
        assert res["final"] == ref["final"] and res["step"] == ref["step"] == 8, rank
    assert pickled_files(run["store"]) == []


@pytest.mark.parametrize(
    ("saved_by", "restored_by", "world"),
    [("fsdp2", "fsdp2", 3), ("fsdp2", "fsdp2", 1), ("fsdp1", "fsdp1", 3), ("fsdp1", "fsdp2", 3)],
)
def test_a_generation_restores_resharded_and_across_fsdp_versions(
    crashed: dict, saved_by: str, restored_by: str, world: int
):
    run = crashed[saved_by]
    out = run["root"] / f"{saved_by}-{restored_by}-{world}"
    reports = _ok(*_run(f"accelerate:{restored_by}:resume", run["store"], world, out))
    saved = run["reference"][0]["saved"]  # whole tensors: the same on every rank
    for report in reports:
        assert report["restored"] == saved
        assert report["step"] == 8  # and training goes on
