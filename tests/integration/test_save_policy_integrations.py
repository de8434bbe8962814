"""Save policies drive the integrations' saves, with the real libraries: the HF
Trainer (its save_steps no longer decide), an Accelerate loop
(``Checkpointer.save_state_if_due``) and a Lightning fit (``PolicyCheckpoint``).
Tiny models, a few steps each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import UsageError


def _steps(store: Path, run_id: str) -> list[int]:
    with cv.CheckpointManager(store, run_id=run_id) as manager:
        return sorted(g.step for g in manager.generations())


def test_the_hf_trainer_saves_when_the_managers_policy_says_so(tmp_path: Path):
    transformers = pytest.importorskip("transformers")
    from ckptvault.integrations.huggingface import CkptvaultTrainer

    transformers.set_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=4)
    tokens = torch.randint(0, 16, (4, 4), generator=torch.Generator().manual_seed(1))
    args = transformers.TrainingArguments(
        str(tmp_path / "out"),
        max_steps=5,
        save_steps=1,  # the Trainer alone would save every step
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    policy = cv.Every(steps=2)
    with cv.CheckpointManager(tmp_path / "store", run_id="hf", save_policy=policy) as manager:
        trainer = CkptvaultTrainer(
            model=transformers.GPT2LMHeadModel(config),
            args=args,
            train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
            checkpoint_manager=manager,
        )
        trainer.train()
    # The policy's steps, and the Trainer's save at the end of training.
    assert _steps(tmp_path / "store", "hf") == [2, 4, 5]


def test_an_accelerate_loop_saves_when_the_managers_policy_says_so(tmp_path: Path):
    accelerate = pytest.importorskip("accelerate")
    from ckptvault.integrations.accelerate import Checkpointer

    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    policy = cv.Every(steps=3)
    with cv.CheckpointManager(tmp_path / "store", run_id="acc", save_policy=policy) as manager:
        ckpt = Checkpointer(accelerator, manager)
        handles = {}
        for step in range(1, 8):
            loss = model(torch.ones(2, 4)).sum()
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            handles[step] = ckpt.save_state_if_due(step)
    assert [s for s, h in handles.items() if h is not None] == [3, 6]
    assert _steps(tmp_path / "store", "acc") == [3, 6]


def test_a_lightning_fit_saves_when_the_plugins_policy_says_so(tmp_path: Path):
    pl = pytest.importorskip("lightning.pytorch")
    from ckptvault.integrations.lightning import CkptvaultCheckpointIO
    from ckptvault.integrations.lightning_policy import PolicyCheckpoint

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    with pytest.raises(UsageError, match="does not take every_n_train_steps"):
        PolicyCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    plugin = CkptvaultCheckpointIO(tmp_path / "store", run_id="pl", save_policy=cv.Every(steps=3))
    trainer = pl.Trainer(
        max_steps=7,
        plugins=[plugin],
        callbacks=[PolicyCheckpoint(dirpath=tmp_path / "ckpt", save_top_k=-1, save_last=True)],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    assert _steps(tmp_path / "store", "pl") == [3, 6]
    pointers = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert pointers == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"]
