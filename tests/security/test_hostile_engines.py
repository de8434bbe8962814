"""Hostile engine generations: what an attacker who can write an unsigned store puts in
a DeepSpeed or FSDP generation's state, restored into a real engine.

Every edit must be refused as a typed ``StateMismatchError`` before anything is
applied: the live engine (weights, moments, steps, hyperparameters, counters, loss
scaler) and a plain entry restored beside it stay exactly as they were. Engines run
for real (DeepSpeed with its CPU accelerator, one gloo rank) in a worker process
(``support/engine_hostile_worker.py``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from support.engine_hostile_worker import DEEPSPEED_ATTACKS, FSDP_ATTACKS
from support.multirank import launch

WORKER = Path(__file__).parents[1] / "support" / "engine_hostile_worker.py"


def _run(scenario: str, tmp_path: Path, world: int = 1) -> list[dict[str, Any]]:
    codes, reports = launch(
        scenario, tmp_path / "store", world, tmp_path / "out", timeout=240, worker=WORKER
    )
    assert codes == [0] * world, [report.get("log", "")[-3000:] for report in reports]
    return reports


def test_a_forged_deepspeed_generation_is_refused_before_anything_is_applied(tmp_path: Path):
    pytest.importorskip("deepspeed")
    (report,) = _run("deepspeed-forged", tmp_path)
    for attack in DEEPSPEED_ATTACKS:
        outcome = report[attack]
        assert outcome["error"].startswith("ckptvault.errors."), (attack, outcome["error"])
        assert (
            "StateMismatchError" in outcome["error"] or "NoValidCheckpoint" in outcome["error"]
        ), (attack, outcome["error"])
        assert outcome["engine untouched"] and outcome["meta untouched"], (attack, outcome)
    # The messages say where and what.
    assert (
        "state['deepspeed']['optimizer']: not a counter" in report["counter named optimizer"]["error"]
    )
    assert "['param_groups'][0]['lr']: the checkpoint holds str" in report["lr a string"]["error"]
    assert report["unedited"] == {"error": "ok", "meta": {"tokens": 7}}


def test_a_dynamic_loss_scaler_is_saved_and_restored(tmp_path: Path):
    """fp16 engines keep a DynamicLossScaler; its state used to go through int() with
    the counters (TypeError: a dict), after the weights had been set."""
    pytest.importorskip("deepspeed")
    (report,) = _run("deepspeed-loss-scaler", tmp_path)
    assert report["error"] == "ok"
    assert report["scaler"] == [4096.0, 7, 1] and report["same"]


def test_a_forged_fsdp_generation_is_refused_before_anything_is_applied(tmp_path: Path):
    """The template's tensors are the live FSDP2 model's and optimizer's own: a
    generation DCP's setters would refuse half-way (a KeyError or a zip() ValueError
    after the weights and moments were copied in place, a string left as the
    optimizer's step) is refused while the restore plans. A generation of the other
    engine (same parameter names and shapes) is refused the same way."""
    pytest.importorskip("deepspeed")
    (report,) = _run("fsdp-forged", tmp_path)
    for attack in [*FSDP_ATTACKS, "fsdp into deepspeed", "deepspeed into fsdp"]:
        outcome = report[attack]
        assert outcome["error"].startswith("ckptvault.errors.StateMismatchError"), (
            attack,
            outcome["error"],
        )
        assert outcome["untouched"], (attack, outcome)
    assert (
        "['param_groups'][0]['params']: the checkpoint's group holds"
        in (report["params renamed"]["error"])
    )
    assert (
        "['step']: the checkpoint holds str, the live state a tensor"
        in (report["step a string"]["error"])
    )
    assert report["unedited"] == {"error": "ok", "meta": {"tokens": 7}}


def test_a_trainer_rollback_under_deepspeed_is_applied_once_and_reported(tmp_path: Path):
    """Under an engine the Trainer reads the TrainerState and the weights in two
    restores: allow_rollback_to was applied by both (two rollback_allowed audit
    entries for one decision), and the second, finding nothing newer left, gave the
    resume a RestoreInfo saying nothing was rolled back from."""
    pytest.importorskip("deepspeed")
    (report,) = _run("trainer-rollback", tmp_path)
    assert report["info"] == [2, 4]  # step 2, rolled back from step 4
    assert report["audit"].count("rollback_allowed") == 1, report["audit"]


def test_a_restore_that_finds_nothing_leaves_a_fresh_optimizer_fresh(tmp_path: Path):
    """Restoring into an engine first gives its optimizer state to fill (a step of
    learning rate 0, as DCP does): on an empty store Checkpointer.load_state() said
    None, nothing changed, but the optimizer had taken a step, and every later step's
    bias correction was another than a fresh run's."""
    pytest.importorskip("deepspeed")
    (report,) = _run("empty-store", tmp_path)
    assert report["accelerate"] == {"info": None, "same": True}
    assert report["fsdp"] == {"same": True}


def test_a_forged_lightning_fsdp2_generation_is_refused_before_anything_is_applied(
    tmp_path: Path,
):
    """CkptvaultModelParallelStrategy restores into the module's own DTensors and DCP's
    optimizer state: a string lr was loaded (the next step failed with TypeError), an
    optimizer state too many failed zip() after the weights were set."""
    pytest.importorskip("lightning")
    (report,) = _run("lightning-forged", tmp_path)
    for attack in ("lr a string", "an optimizer too many"):
        assert report[attack]["error"].startswith("ckptvault.errors.StateMismatchError"), report[
            attack
        ]["error"]
        assert report[attack]["untouched"], attack
