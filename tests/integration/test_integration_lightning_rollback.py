"""Issue 23, item 2: a planted Lightning pointer must not roll a signed run back.

A signed run (``signing_key``, ``trusted_keys``, a ledger, ``max_fallback=0``) saves
steps 10 to 40 through a real Trainer. Someone who can write ``ModelCheckpoint``'s
directory, but not the store, copies the step-10 pointer over ``last.ckpt``. It used
to make ``fit(ckpt_path="last")`` restore step 10: no error, empty ``skipped``.
Now ``last*.ckpt`` stands for the newest generation that verifies (the pointer is a
hint), and any other pointer of an older step is a ``RollbackError`` unless the
plugin's ``allow_rollback_to`` names it: then the rollback is logged, audited and
shown in ``restore_info``.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptvault.errors import RollbackError
from ckptvault.trust.ledger import Ledger
from ckptvault.trust.signing import generate_keypair

pl = pytest.importorskip("lightning.pytorch")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from ckptvault.integrations.lightning import CkptvaultCheckpointIO  # noqa: E402


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
        self.steps_trained = 0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.steps_trained += 1
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def loader() -> Any:
    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    return torch.utils.data.DataLoader(data, batch_size=4)


def trainer(plugin: CkptvaultCheckpointIO, ckpt: Path, max_steps: int) -> Any:
    return pl.Trainer(
        max_steps=max_steps,
        plugins=[plugin],
        callbacks=[
            ModelCheckpoint(dirpath=ckpt, every_n_train_steps=10, save_top_k=-1, save_last=True)
        ],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=ckpt.parent,
    )


@pytest.fixture
def signed_run(tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """Steps 10, 20, 30 and 40 saved by a signed Lightning run; the plugin's options."""
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    options = {
        "run_id": "lit",
        "signing_key": tmp_path / "k.pem",
        "trusted_keys": [tmp_path / "k.pub"],
        "ledger": tmp_path / "control" / "ledger.sqlite3",
        "max_fallback": 0,
    }
    ckpt = tmp_path / "ckpt"
    torch.manual_seed(0)
    trainer(CkptvaultCheckpointIO(tmp_path / "store", **options), ckpt, 40).fit(Tiny(), loader())
    return options, ckpt


def step_pointer(ckpt: Path, step: int) -> Path:
    (path,) = ckpt.glob(f"epoch=*-step={step}.ckpt")
    return path


def test_a_planted_last_pointer_resumes_the_newest_not_step_10(tmp_path, signed_run):
    options, ckpt = signed_run
    shutil.copy(step_pointer(ckpt, 10), ckpt / "last.ckpt")  # the attack
    plugin = CkptvaultCheckpointIO(tmp_path / "store", **options)
    module = Tiny()
    again = trainer(plugin, ckpt, 50)
    again.fit(module, loader(), ckpt_path="last")
    assert again.ckpt_path == str(ckpt / "last.ckpt")
    assert module.steps_trained == 10  # resumed at 40 (at 10 it would train 40 steps)
    assert plugin.restore_info is not None and plugin.restore_info.step == 40
    assert plugin.restore_info.skipped == []
    assert Ledger(options["ledger"]).floor("lit").step == 40


def test_an_older_pointer_is_a_rollback_only_when_allowed(tmp_path, signed_run, caplog):
    options, ckpt = signed_run
    old = step_pointer(ckpt, 10)
    with pytest.raises(RollbackError, match="allow_rollback_to=10"):
        trainer(CkptvaultCheckpointIO(tmp_path / "store", **options), ckpt, 50).fit(
            Tiny(), loader(), ckpt_path=str(old)
        )
    assert Ledger(options["ledger"]).floor("lit").step is None  # nothing was restored

    plugin = CkptvaultCheckpointIO(tmp_path / "store", allow_rollback_to=10, **options)
    module = Tiny()
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        trainer(plugin, ckpt, 20).fit(module, loader(), ckpt_path=str(old))
    info = plugin.restore_info
    assert info is not None and info.step == 10 and info.rolled_back_from == 40
    assert module.steps_trained == 10
    assert any(
        "rolled back on purpose from step 40 to step 10" in r.message for r in caplog.records
    )
    audit = options["ledger"].parent / "audit.jsonl"
    entries = [json.loads(line) for line in audit.read_text().splitlines()]
    (rollback,) = [e for e in entries if e["event"] == "rollback_allowed"]
    assert (rollback["from_step"], rollback["step"]) == (40, 10)
    assert plugin.allow_rollback_to is None  # honoured once
