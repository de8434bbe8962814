"""FSDP1, FSDP2 and DeepSpeed ZeRO 1-3 through Accelerate's ``Checkpointer``, the
Hugging Face ``CkptvaultTrainer`` and DeepSpeed alone, on real gloo ranks.

Each run trains a small model with dropout on 2 ranks (Accelerate: an MLP with an
LR scheduler and a seedable sampler; Trainer: a tiny GPT-2), saves at step 5, trains
on to step 8 and is SIGKILLed. Its resume in new processes must hold exactly the
saved weights and optimizer state (ZeRO: fp32 weights, moments, module weights,
steps, counters) and end bit-identical to the killed run, nothing pickled. Some
generations are then restored at 3 ranks and at 1 (resharded: the same whole
tensors) and under the other FSDP version or ZeRO stage.

Accelerate enables FSDP only on accelerator devices: the worker turns it on for CPU
ranks (``engine_worker.fsdp_on_cpu``). DeepSpeed runs with its CPU accelerator.
Everything else is the real library.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from support.multirank import launch
from support.readme_runs import pickled_files

WORKER = Path(__file__).parents[1] / "support" / "engine_worker.py"
KILLED, STEPS = [-9, -9], 8

# (integration, engine), then the (engine, ranks) its generation is also restored by.
# The whole matrix runs in `make test-extended`; `make test` keeps FSDP2 and FSDP1
# through Accelerate (resharded, and FSDP1 restored as FSDP2), FSDP1 through the
# Trainer, and ZeRO-3 through DeepSpeed alone (10-minute budget).
_EXTENDED = pytest.mark.extended
RUNS: list[Any] = [
    ("accelerate", "fsdp2", [("fsdp2", 3), ("fsdp2", 1)]),
    ("accelerate", "fsdp1", [("fsdp1", 3), ("fsdp2", 3)]),
    pytest.param("accelerate", "fsdp1-FULL_STATE_DICT", [], marks=_EXTENDED),
    pytest.param("trainer", "fsdp2", [], marks=_EXTENDED),
    ("trainer", "fsdp1", [("fsdp2", 3)]),
    pytest.param("accelerate", "zero1", [], marks=_EXTENDED),
    pytest.param("accelerate", "zero2", [("zero2", 3), ("zero3", 3)], marks=_EXTENDED),
    pytest.param("accelerate", "zero3", [("zero3", 3), ("zero3", 1)], marks=_EXTENDED),
    pytest.param("trainer", "zero1", [], marks=_EXTENDED),
    pytest.param("trainer", "zero2", [], marks=_EXTENDED),
    pytest.param("trainer", "zero3", [], marks=_EXTENDED),
    ("deepspeed", "zero3", []),
]


def _run(scenario: str, store: Path, world: int, out: Path) -> tuple[list[int], list[Any]]:
    return launch(scenario, store, world, out, timeout=300, worker=WORKER)


def _ok(codes: list[int], reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    assert codes == [0] * len(codes), [report["log"][-2000:] for report in reports]
    return reports


@pytest.mark.parametrize(("integration", "engine", "restored_by"), RUNS)
def test_a_killed_run_resumes_bit_identically_and_reshards(
    tmp_path: Path, integration: str, engine: str, restored_by: list[tuple[str, int]]
):
    if engine.startswith("zero"):
        pytest.importorskip("deepspeed")
    store = tmp_path / "store"
    codes, reference = _run(f"{integration}:{engine}:reference", store, 2, tmp_path / "ref")
    assert codes == KILLED, [report["log"][-2000:] for report in reference]

    resumed = _ok(*_run(f"{integration}:{engine}:resume", store, 2, tmp_path / "resume"))
    for rank, (ref, res) in enumerate(zip(reference, resumed, strict=True)):
        assert res["engine"] == ref["engine"] != "none", rank
        assert res["restored"] == ref["saved"], rank  # every tensor, whole
        assert res["final"] == ref["final"] and res["step"] == ref["step"] == STEPS, rank
        assert res.get("losses") == ref.get("losses"), rank  # Trainer: every logged loss
    assert pickled_files(tmp_path) == []

    for other, world in restored_by:
        out = tmp_path / f"{other}-{world}"
        for report in _ok(*_run(f"{integration}:{other}:resume", store, world, out)):
            assert report["restored"] == reference[0]["saved"], (other, world)
            assert report["step"] == STEPS  # and training goes on


def test_deepspeed_saves_the_module_state_its_optimizer_does_not_hold(tmp_path: Path):
    """BatchNorm's running statistics and a frozen layer (``requires_grad=False``,
    set after the model was built, as a pretrained load does) are the module's state,
    not the optimizer's: they were left out of the generation, and a resume kept the
    new model's (fresh statistics, another seed's frozen weights) without a word. Every
    rank gets rank 0's, as DeepSpeed's own checkpoint gives them (each rank's
    statistics differ: its own batches)."""
    pytest.importorskip("deepspeed")
    worker = Path(__file__).parents[1] / "support" / "engine_hostile_worker.py"
    codes, reports = launch(
        "deepspeed-module-state", tmp_path / "store", 2, tmp_path / "out", 240, worker
    )
    _ok(codes, reports)
    for stage in ("zero1", "zero3"):
        saved = reports[0][stage]["saved"]
        assert saved["frozen"][1] == [5.0, 6.0, 7.0, 8.0, 9.0]
        assert saved["1.num_batches_tracked"] == 2
        assert reports[1][stage]["saved"]["1.running_mean"] != saved["1.running_mean"]
        for report in reports:
            assert report[stage]["error"] == "ok", report[stage]["error"]
            assert report[stage]["restored"] == saved, (stage, report["rank"])
