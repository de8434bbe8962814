"""DeepSpeed ZeRO stages 1, 2 and 3 saved through ``ckptvault.engines.deepspeed``,
on real gloo ranks with DeepSpeed's CPU accelerator.

Each stage trains a small model with dropout on 2 ranks, saves at step 3 and trains
on to step 8, and is SIGKILLed; a resume in new processes must hold exactly the
saved fp32 weights, moments, module weights, steps and counters and end
bit-identical to the killed run. The generation then restores at 3 ranks and at 1
(resharded, as DeepSpeed's universal checkpoint allows) and across stages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from support.multirank import launch
from support.readme_runs import pickled_files

pytest.importorskip("deepspeed")

WORKER = Path(__file__).parents[1] / "support" / "engine_worker.py"
STAGES = ["zero1", "zero2", "zero3"]


def _run(scenario: str, store: Path, world: int, out: Path) -> tuple[list[int], list[Any]]:
    return launch(scenario, store, world, out, timeout=300, worker=WORKER)


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Per stage: the reports of a run that saved at step 3, trained to step 8 and
    was SIGKILLed, and the store it left."""
    runs: dict[str, Any] = {}
    for stage in STAGES:
        root = tmp_path_factory.mktemp(stage)
        codes, reports = _run(f"deepspeed:{stage}:reference", root / "store", 2, root / "ref")
        assert codes == [-9, -9], [report["log"][-2000:] for report in reports]
        runs[stage] = {"reference": reports, "store": root / "store", "root": root}
    return runs


def _resumed(run: dict[str, Any], stage: str, world: int, name: str) -> list[dict[str, Any]]:
    codes, reports = _run(f"deepspeed:{stage}:resume", run["store"], world, run["root"] / name)
    assert codes == [0] * world, [report["log"][-2000:] for report in reports]
    return reports


@pytest.mark.parametrize("stage", STAGES)
def test_a_killed_zero_run_resumes_bit_identically(killed: dict, stage: str):
    run = killed[stage]
    resumed = _resumed(run, stage, 2, "resume")
    for rank, (ref, res) in enumerate(zip(run["reference"], resumed, strict=True)):
        assert res["engine"] == stage, rank
        assert res["restored"] == ref["saved"], rank  # fp32, moments, module, steps
        assert res["final"] == ref["final"] and res["step"] == ref["step"] == 8, rank
    assert pickled_files(run["root"]) == []


@pytest.mark.parametrize(
    ("saved_by", "restored_by", "world"),
    [("zero2", "zero2", 3), ("zero3", "zero3", 3), ("zero3", "zero3", 1), ("zero2", "zero3", 3)],
)
def test_a_zero_generation_restores_resharded_and_across_stages(
    killed: dict, saved_by: str, restored_by: str, world: int
):
    run = killed[saved_by]
    reports = _resumed(run, restored_by, world, f"{restored_by}-{world}")
    saved = run["reference"][0]["saved"]  # whole tensors: the same on every rank
    for report in reports:
        assert report["restored"] == saved
        assert report["step"] == 8  # and training goes on
