"""Issue 23, item 2, for the Hugging Face integrations: a path or an explicit older
step does not roll a run with a ledger back silently.

``CkptvaultTrainer.train(resume_from_checkpoint=...)``: once the store holds the
run's generations, ``.../checkpoint-N`` (what ``get_last_checkpoint`` finds in an
output directory anyone with write access could plant) is step N from the store,
held to restore's rollback rule, and any other path is refused rather than read by
Trainer unverified. Accelerate's ``Checkpointer.load_state(step=N)`` likewise; it
takes no directory at all. ``allow_rollback_to`` goes back on purpose.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed

import ckptvault as cv
from ckptvault.errors import RollbackError, UsageError
from ckptvault.integrations.accelerate import Checkpointer
from ckptvault.integrations.huggingface import CkptvaultTrainer
from ckptvault.trust.ledger import Ledger

MAX_STEPS, SAVE_STEPS = 6, 2  # saves steps 2, 4 and 6


def _trainer(root: Path, manager: cv.CheckpointManager) -> CkptvaultTrainer:
    set_seed(0)
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    tokens = torch.randint(0, 16, (8, 8), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(
        str(root / "out"),
        max_steps=MAX_STEPS,
        save_steps=SAVE_STEPS,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    return CkptvaultTrainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
        checkpoint_manager=manager,
    )


@pytest.fixture
def hf_run(tmp_path: Path) -> dict[str, Any]:
    options = {"run_id": "hf", "ledger": tmp_path / "control" / "ledger.sqlite3"}
    with cv.CheckpointManager(tmp_path / "store", **options) as manager:
        _trainer(tmp_path, manager).train()
        assert sorted(g.step for g in manager.generations()) == [2, 4, 6]
    return options


@pytest.mark.parametrize("resume", ["out/checkpoint-2", 2], ids=["a-checkpoint-2-path", "step-2"])
def test_an_older_checkpoint_path_or_step_is_refused_without_the_allowance(
    tmp_path, hf_run, resume
):
    if isinstance(resume, str):
        resume = str(tmp_path / resume)  # need not exist: only its name is read
    with cv.CheckpointManager(tmp_path / "store", **hf_run) as manager:
        trainer = _trainer(tmp_path, manager)
        before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        with pytest.raises(RollbackError, match="allow_rollback_to=2"):
            trainer.train(resume_from_checkpoint=resume)
        for name, tensor in trainer.model.state_dict().items():
            assert torch.equal(tensor, before[name]), name
    assert Ledger(hf_run["ledger"]).floor("hf").step is None


def test_a_rollback_on_purpose_and_the_newest_path(tmp_path, hf_run):
    with cv.CheckpointManager(tmp_path / "store", **hf_run) as manager:
        trainer = _trainer(tmp_path, manager)
        trainer.train(
            resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"), allow_rollback_to=2
        )
        info = trainer.restore_info
        assert info is not None and info.step == 2 and info.rolled_back_from == 6
        assert trainer.state.global_step == MAX_STEPS
    with cv.CheckpointManager(tmp_path / "store", **hf_run) as manager:
        trainer = _trainer(tmp_path, manager)  # the newest (a new step 6) by its path
        trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-6"))
        assert trainer.restore_info is not None and trainer.restore_info.step == 6


def test_a_path_that_names_no_step_is_refused_once_the_run_has_history(tmp_path, hf_run):
    planted = tmp_path / "out" / "best-model"
    planted.mkdir(parents=True)
    with (
        cv.CheckpointManager(tmp_path / "store", **hf_run) as manager,
        pytest.raises(UsageError, match="would resume the run unverified"),
    ):
        _trainer(tmp_path, manager).train(resume_from_checkpoint=str(planted))


def test_accelerate_load_state_of_an_older_step_is_refused_without_the_allowance(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    options = {"run_id": "acc", "ledger": tmp_path / "control" / "ledger.sqlite3"}
    with cv.CheckpointManager(tmp_path / "store", **options) as manager:
        ckpt = Checkpointer(accelerator, manager)
        for step in (5, 10):
            with torch.no_grad():
                model.weight.fill_(step)
            ckpt.save_state(step)
        with torch.no_grad():
            model.weight.fill_(-1)
        with pytest.raises(RollbackError, match="allow_rollback_to=5"):
            ckpt.load_state(step=5)
        assert torch.equal(model.weight, torch.full((2, 2), -1.0))  # untouched
        with pytest.raises(UsageError, match="takes the step of a generation"):
            ckpt.load_state(str(tmp_path / "checkpoints" / "checkpoint_0"))  # type: ignore[arg-type]
        info = ckpt.load_state(allow_rollback_to=5)
        assert info is not None and info.step == 5 and info.rolled_back_from == 10
        assert torch.equal(model.weight, torch.full((2, 2), 5.0))
