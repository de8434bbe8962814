"""The Hugging Face Trainer integration (ckptvault.integrations.huggingface), run
against the real transformers: a tiny GPT-2 trained, interrupted and resumed must
end bit-identical to an uninterrupted run (every logged loss, learning rate and
gradient norm, every weight), with nothing pickled.

The documented example (docs/guides/integrations.md) runs as written in fresh
processes: a reference run, a run
SIGKILLed mid-epoch, and its resume in a new process. In-process runs (fresh
Trainer objects after an interruption), all with gradient accumulation, cover an
epoch boundary, an explicit step mid-epoch, and a resume that falls back past a
damaged generation.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    TrainerCallback,
    TrainingArguments,
    set_seed,
)

import ckptvault as cv
from ckptvault.errors import UsageError
from ckptvault.integrations.huggingface import CkptvaultTrainer
from support.common import only_tensor_file, writable
from support.readme_runs import (
    assert_killed,
    pickled_files,
    readme_block,
    run_example,
)

# -- the documented example, in fresh processes ---------------------------------------

HARNESS = """
import hashlib, json, os, signal
from pathlib import Path
import torch
torch.set_num_threads(1)
import transformers

BLOCK, MODE, KILL_AT = {block!r}, {mode!r}, {kill_at!r}
BASE = Path.cwd()
calls = [0]
original_training_step = transformers.Trainer.training_step

def training_step(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)  # a crash mid-run: no cleanup at all
    return original_training_step(self, *args, **kwargs)

def run(where):
    (BASE / where).mkdir(exist_ok=True)
    os.chdir(BASE / where)
    namespace = {{"__name__": "__main__"}}
    exec(BLOCK, namespace)
    trainer = namespace["trainer"]
    weights = {{k: hashlib.sha256(v.detach().cpu().numpy().tobytes()).hexdigest()
               for k, v in trainer.model.state_dict().items()}}
    info = trainer.restore_info
    result = {{"logs": [e for e in trainer.state.log_history if "loss" in e],
              "weights": weights, "resumed_at": info.step if info else None}}
    (BASE / f"{{where}}.json").write_text(json.dumps(result))

if MODE == "reference+crash":
    run("reference")
    transformers.Trainer.training_step = training_step
    run("interrupted")
    raise SystemExit("the armed SIGKILL did not fire")
run("interrupted")  # MODE == "resume"
"""


def _harness(mode: str, kill_at: int | None = None) -> str:
    block = readme_block("### Hugging Face Trainer")
    return HARNESS.format(block=block, mode=mode, kill_at=kill_at)


@pytest.mark.heavy
def test_the_readme_trainer_example_resumes_bit_identically_after_sigkill(tmp_path: Path):
    # 8 steps an epoch, saves every 5: killed in step 12, resumed at step 10, mid-epoch.
    crashed = run_example(_harness("reference+crash", kill_at=12), tmp_path)
    assert_killed(crashed)
    resumed = run_example(_harness("resume"), tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    reference = json.loads((tmp_path / "reference.json").read_text())
    result = json.loads((tmp_path / "interrupted.json").read_text())
    assert reference["resumed_at"] is None  # an empty store: a fresh start
    assert result["resumed_at"] == 10
    # Every step's log, before the kill (from the restored TrainerState) and after it.
    assert [e["step"] for e in result["logs"]] == list(range(1, 16))
    assert result["logs"] == reference["logs"]
    assert result["weights"] == reference["weights"]
    assert pickled_files(tmp_path) == []
    assert not list((tmp_path / "interrupted" / "out").glob("checkpoint-*"))


# -- in-process runs: fresh Trainer objects after an interruption -----------------------

# 8 samples, 2 a batch, 2 batches a step: 2 steps an epoch; saves at steps 3, 6 and 9.
MAX_STEPS, SAVE_STEPS, INTERRUPT_AT = 9, 3, 8


class _Interrupted(Exception):
    pass


class _InterruptAt(TrainerCallback):
    """Ends the run like a crash would: an exception in the middle of the loop."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            raise _Interrupted(self.step)


def _train(
    root: Path, resume: Any = True, interrupt_at: int | None = None, **options: Any
) -> CkptvaultTrainer:
    set_seed(0)
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    model = GPT2LMHeadModel(config)  # dropout on: the RNGs matter
    tokens = torch.randint(0, 32, (8, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = TrainingArguments(
        str(root / "out"),
        max_steps=MAX_STEPS,
        save_steps=SAVE_STEPS,
        logging_steps=1,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
        **options,
    )
    callbacks = [_InterruptAt(interrupt_at)] if interrupt_at else []
    with cv.CheckpointManager(root / "store", run_id="hf-test") as manager:
        trainer = CkptvaultTrainer(
            model=model,
            args=args,
            train_dataset=data,
            checkpoint_manager=manager,
            callbacks=callbacks,
        )
        with contextlib.suppress(_Interrupted):
            trainer.train(resume_from_checkpoint=resume)
    return trainer


def _outcome(trainer: CkptvaultTrainer) -> tuple[list[dict], dict[str, torch.Tensor]]:
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return logs, weights


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict], dict]:
    """An uninterrupted run, and where its store is."""
    root = tmp_path_factory.mktemp("reference")
    return (root, *_outcome(_train(root)))


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store left by a run interrupted in step 8: generations of steps 3 and 6."""
    root = tmp_path_factory.mktemp("interrupted")
    _train(root, interrupt_at=INTERRUPT_AT)
    assert sorted(g.step for g in _generations(root / "store")) == [3, 6]
    return root / "store"


def _generations(store: Path) -> list[Any]:
    with cv.CheckpointManager(store, run_id="hf-test") as manager:
        return manager.generations()


def _damage(generation: Path) -> None:
    data = writable(only_tensor_file(generation))
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0xFF
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("resume", "damage", "resumed_at"),
    [
        pytest.param(True, False, 6, id="newest-at-an-epoch-boundary"),
        pytest.param(3, False, 3, id="an-explicit-step-mid-epoch"),
        pytest.param(True, True, 3, id="falling-back-past-a-damaged-newest"),
    ],
)
def test_a_resumed_trainer_continues_bit_identically(
    tmp_path: Path, reference: tuple, interrupted: Path, resume: Any, damage: bool, resumed_at: int
):
    # Gradient accumulation throughout: a mid-epoch resume skips micro-batches.
    shutil.copytree(interrupted, tmp_path / "store")
    if damage:
        (newest,) = [g for g in _generations(tmp_path / "store") if g.step == 6]
        _damage(Path(newest.path))
    trainer = _train(tmp_path, resume=resume)

    info = trainer.restore_info
    assert info is not None and info.step == resumed_at
    assert [s[1] for s in info.skipped] == ([6] if damage else [])
    logs, weights = _outcome(trainer)
    assert logs == reference[1]  # loss, grad_norm, learning_rate, epoch of every step
    assert weights.keys() == reference[2].keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference[2][name]), name
    assert trainer.state.global_step == MAX_STEPS
    assert pickled_files(tmp_path) == []


def test_each_save_records_the_steps_logged_numbers_as_metrics(reference: tuple):
    root, logs, _ = reference
    (generation,) = [g for g in _generations(root / "store") if g.step == 3]
    manifest = json.loads((Path(generation.path) / "manifest.json").read_text())
    (logged,) = [entry for entry in logs if entry["step"] == 3]
    assert manifest["metrics"]["loss"] == logged["loss"]
    assert manifest["metrics"]["learning_rate"] == logged["learning_rate"]


@pytest.mark.parametrize(
    "options",
    [
        {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 3},
        {"save_only_model": True},
    ],
    ids=["load_best_model_at_end", "save_only_model"],
)
def test_options_it_cannot_honour_are_refused_at_construction(tmp_path: Path, options: dict):
    args = TrainingArguments(
        str(tmp_path / "out"), save_steps=3, use_cpu=True, report_to="none", **options
    )
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=8))
    sample = [{"input_ids": torch.zeros(4, dtype=torch.long)}]
    with (
        cv.CheckpointManager(tmp_path / "store", run_id="hf-test") as manager,
        pytest.raises(UsageError, match=next(iter(options))),
    ):
        CkptvaultTrainer(model=model, args=args, eval_dataset=sample, checkpoint_manager=manager)
