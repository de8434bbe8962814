"""Multi-rank Lightning fits through ckptvault's strategies, for the tests.

``python lightning_worker.py SCENARIO OUT`` (started by the fork server: torch is
imported already) imports Lightning once and then forks each rank of each phase of
``SCENARIO`` (``ddp``, ``fsdp2``) from this process, which runs no torch op of its
own: every rank is a real process with its own process group (gloo, 127.0.0.1),
and a rank "stopped" at a save is SIGKILLed right after it. Each rank writes what it
saw to ``OUT/<phase>-rank<r>.json``; the phases' exit codes go to ``OUT/codes.json``.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.distributed.tensor import DTensor
from torchdata.stateful_dataloader import StatefulDataLoader

from ckptvault.integrations.lightning import CkptvaultCheckpointIO
from ckptvault.integrations.lightning_strategies import (
    CkptvaultDDPStrategy,
    CkptvaultModelParallelStrategy,
)

# 32 samples in batches of 4 over 2 ranks: 4 steps an epoch, 10 steps a fit. The
# stopped run dies after the save of step STOP_AT: DDP's mid-epoch in epoch 1 (the
# second), FSDP2's right after the last batch of epoch 1.
STEPS, SAMPLES, BATCH = 10, 32, 4
SAVE_EVERY = {"ddp": 3, "fsdp2": 4}
STOP_AT = {"ddp": 6, "fsdp2": 8}


def hexed(tensor: torch.Tensor) -> str:
    whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
    return whole.detach().contiguous().numpy().tobytes().hex()


class Regression(pl.LightningModule):
    """Dropout draws from each rank's own RNG (seeded per rank): the module carries it
    through on_save_checkpoint, so a resume must give each rank its own back."""

    def __init__(self, shard: bool) -> None:
        super().__init__()
        self.shard = shard
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Dropout(0.3), torch.nn.Linear(16, 1)
        )
        self.report: dict[str, Any] = {"losses": []}

    def configure_model(self) -> None:
        if self.shard:
            from torch.distributed.fsdp import fully_shard

            mesh = self.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.report["losses"].append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.1)

    def state(self) -> dict[str, Any]:
        """Every parameter and optimizer state tensor, whole, as hex bytes."""
        optimizer = self.trainer.optimizers[0]
        return {
            "params": {name: hexed(p) for name, p in self.net.named_parameters()},
            "moments": {
                f"{index}/{key}": hexed(value)
                for index, p in enumerate(self.net.parameters())
                for key, value in optimizer.state[p].items()
            },
            "rng": hexed(torch.get_rng_state()),
        }

    def on_train_start(self) -> None:
        self.report["start"] = self.state()  # after a resume: what was restored

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["torch_rng"] = torch.get_rng_state()
        self.report[f"saved_{self.global_step}"] = self.state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        torch.set_rng_state(checkpoint["torch_rng"])


class SaveThenDie(ModelCheckpoint):
    """ModelCheckpoint, and the process SIGKILLs itself after the save of ``die_at``."""

    def __init__(self, die_at: int | None, out: Path, **options: Any) -> None:
        super().__init__(**options)
        self.die_at, self.out = die_at, out

    def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
        super().on_train_batch_end(trainer, module, *args)
        if trainer.global_step == self.die_at:
            module.report["killed_at"] = trainer.global_step
            self.out.write_text(json.dumps(module.report))
            os.kill(os.getpid(), signal.SIGKILL)


class Warnings(logging.Handler):
    """ckptvault's warnings, into the report."""

    def __init__(self, report: dict[str, Any]) -> None:
        super().__init__(logging.WARNING)
        self.report = report

    def emit(self, record: logging.LogRecord) -> None:
        self.report.setdefault("warnings", []).append(record.getMessage())


def fit(scenario: str, phase: str, rank: int, world: int, out: Path) -> None:
    shard = scenario == "fsdp2"
    store, ckpt = out / f"store-{phase.split('-')[0]}", out / f"ckpt-{phase.split('-')[0]}"
    report_path = out / f"{phase}-rank{rank}.json"
    torch.manual_seed(0)  # the same initial weights on every rank
    module = Regression(shard)
    logging.getLogger("ckptvault").addHandler(Warnings(module.report))
    torch.manual_seed(100 + rank)  # each rank its own dropout masks
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, 4, generator=generator), torch.randn(SAMPLES, 1, generator=generator)
    )
    # Lightning shuffles it: a DistributedSampler, whose order set_epoch decides. Its
    # own generator: the iterator's seed draw must not take from the global RNG.
    loader = StatefulDataLoader(data, batch_size=BATCH, generator=torch.Generator().manual_seed(5))
    strategy = (  # "auto" would make the 2 ranks tensor-parallel, each its own FSDP group
        CkptvaultModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1)
        if shard
        else CkptvaultDDPStrategy()
    )
    saves = SaveThenDie(
        STOP_AT[scenario] if phase in ("stopped", "alone") else None,
        report_path,
        dirpath=ckpt,
        every_n_train_steps=SAVE_EVERY[scenario],
        save_last=True,
    )
    resharded = phase.endswith("resharded")  # it only loads: the store stays as it was
    trainer = pl.Trainer(
        max_steps=STOP_AT[scenario] + 1 if resharded else STEPS,
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        plugins=[CkptvaultCheckpointIO(store, run_id=scenario, collective_timeout_s=60)],
        callbacks=[] if resharded else [saves],
        enable_checkpointing=not resharded,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=out,
    )
    # No ModelCheckpoint when resharded, to find "last" with: its path.
    resume = (ckpt / "last.ckpt" if resharded else "last") if "-" in phase else None
    trainer.fit(module, loader, ckpt_path=resume)
    module.report.update(end=module.state(), global_step=trainer.global_step)
    restored = trainer.strategy.checkpoint_io.restore_info
    if restored is not None:
        module.report["restored"] = {"step": restored.step, "reset": restored.reset}
    report_path.write_text(json.dumps(module.report))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_phase(scenario: str, phase: str, world: int, out: Path) -> list[int]:
    """Fork ``world`` ranks of ``phase``; their exit codes (-9: SIGKILLed)."""
    port, pids = free_port(), []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                os.environ.update(
                    RANK=str(rank),
                    LOCAL_RANK=str(rank),
                    NODE_RANK="0",
                    WORLD_SIZE=str(world),
                    MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port),
                )
                fit(scenario, phase, rank, world, out)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)  # no teardown of what the driver imported
        pids.append(pid)
    return [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]


PHASES = {
    # phase: number of ranks
    # "alone": one process saves, two resume.
    "ddp": {"whole": 2, "stopped": 2, "stopped-resumed": 2, "alone": 1, "alone-grown": 2},
    # Resharded before resumed: "last" is still STOP_AT (the resharded fit saves nothing).
    "fsdp2": {"whole": 2, "stopped": 2, "stopped-resharded": 1, "stopped-resumed": 2},
}


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    out.mkdir(parents=True, exist_ok=True)
    codes = {}
    for phase, world in PHASES[scenario].items():
        codes[phase] = run_phase(scenario, phase, world, out)
    (out / "codes.json").write_text(json.dumps(codes))


if __name__ == "__main__":
    main()
