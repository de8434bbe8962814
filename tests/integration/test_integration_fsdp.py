"""FSDP1 and FSDP2 through Accelerate's ``Checkpointer`` and the Hugging Face
``CkptvaultTrainer``, on 2 real gloo ranks.

Each run trains a small model with dropout (Accelerate: an MLP with an LR scheduler
and a seedable sampler; Trainer: a tiny GPT-2): a reference run, and a run SIGKILLed
right after its save at step 3 whose resume in new processes must hold exactly the
saved weights and optimizer state and end bit-identical to the reference. The
generation then restores at 3 ranks and at 1 (resharded: the same whole tensors),
and one saved under FSDP1 restores under FSDP2. Accelerate enables FSDP only on
accelerator devices; the worker turns it on for CPU ranks
(``engine_worker.fsdp_on_cpu``), everything else is real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from support.multirank import launch
from support.readme_runs import pickled_files

WORKER = Path(__file__).parents[1] / "support" / "engine_worker.py"
RUNS = [
    ("accelerate", "fsdp2"),
    ("accelerate", "fsdp1"),
    ("accelerate", "fsdp1-FULL_STATE_DICT"),
    ("trainer", "fsdp2"),
    ("trainer", "fsdp1"),
]


def _run(scenario: str, store: Path, world: int, out: Path) -> tuple[list[int], list[Any]]:
    return launch(scenario, store, world, out, timeout=240, worker=WORKER)


def _ok(codes: list[int], reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    assert codes == [0] * len(codes), [report["log"][-2000:] for report in reports]
    return reports


@pytest.fixture(scope="module")
def crashed(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Any]:
    """Per integration and engine: the reference run's reports, and the store of a
    run killed right after its save at step 3."""
    runs: dict[tuple[str, str], Any] = {}
    for integration, engine in RUNS:
        root = tmp_path_factory.mktemp(f"{integration}-{engine}")
        reference = _ok(
            *_run(f"{integration}:{engine}:reference", root / "ref" / "store", 2, root / "r")
        )
        codes, _ = _run(f"{integration}:{engine}:crash", root / "store", 2, root / "c")
        assert codes == [-9, -9]  # SIGKILLed, no cleanup
        runs[integration, engine] = {"reference": reference, "store": root / "store", "root": root}
    return runs


@pytest.mark.parametrize(("integration", "engine"), RUNS)
def test_a_run_killed_after_a_save_resumes_bit_identically(
    crashed: dict, integration: str, engine: str
):
    run = crashed[integration, engine]
    scenario = f"{integration}:{engine}:resume"
    resumed = _ok(*_run(scenario, run["store"], 2, run["root"] / "go"))
    for rank, (ref, res) in enumerate(zip(run["reference"], resumed, strict=True)):
        assert res["engine"] in ("DistributedType.FSDP", "fsdp"), rank
        assert res["restored"] == ref["saved"], rank  # every weight and moment, whole
        assert res["final"] == ref["final"] and res["step"] == ref["step"] == 8, rank
        assert res.get("losses") == ref.get("losses"), rank  # Trainer: every logged loss
    assert pickled_files(run["root"]) == []


@pytest.mark.parametrize(
    ("saved_by", "restored_by", "world"),
    [
        (("accelerate", "fsdp2"), "fsdp2", 3),
        (("accelerate", "fsdp2"), "fsdp2", 1),
        (("accelerate", "fsdp1"), "fsdp1", 3),
        (("accelerate", "fsdp1"), "fsdp2", 3),
        (("trainer", "fsdp1"), "fsdp2", 3),
    ],
)
def test_a_generation_restores_resharded_and_across_fsdp_versions(
    crashed: dict, saved_by: tuple[str, str], restored_by: str, world: int
):
    run = crashed[saved_by]
    out = run["root"] / f"{restored_by}-{world}"
    reports = _ok(*_run(f"{saved_by[0]}:{restored_by}:resume", run["store"], world, out))
    saved = run["reference"][0]["saved"]  # whole tensors: the same on every rank
    for report in reports:
        assert report["restored"] == saved
        assert report["step"] == 8  # and training goes on
