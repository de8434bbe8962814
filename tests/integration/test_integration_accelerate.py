"""The Accelerate integration (ckptvault.integrations.accelerate), run against the
real accelerate: a model with dropout trained by an Accelerate loop, interrupted and
resumed, must end bit-identical to an uninterrupted run (every loss, every weight),
with nothing pickled.

The documented example (docs/guides/integrations.md) runs as written in fresh
processes: a reference run, a run
SIGKILLed mid-epoch, and its resume in a new process. In-process runs (fresh
Accelerator and objects after an interruption), with gradient accumulation, an LR
scheduler, a registered custom object and an extra entry, resume mid-epoch, after
the last batch of an epoch, and mid gradient accumulation (``include_grads=True``),
with a seedable sampler, and with a StatefulDataLoader as well.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed

import ckptvault as cv
from ckptvault.errors import UsageError
from ckptvault.integrations.accelerate import Checkpointer
from support.readme_runs import assert_killed, pickled_files, readme_block, run_example

# -- the documented example, in fresh processes ---------------------------------------

HARNESS = """
import hashlib, json, os, signal
from pathlib import Path
import torch
torch.set_num_threads(1)
import accelerate

BLOCK, MODE, KILL_AT = {block!r}, {mode!r}, {kill_at!r}
BASE = Path.cwd()
losses = []
original_backward = accelerate.Accelerator.backward

def backward(self, loss, **kwargs):
    losses.append(loss.item())
    if len(losses) == KILL_AT and MODE == "reference+crash" and Path.cwd().name == "interrupted":
        os.kill(os.getpid(), signal.SIGKILL)  # a crash mid-run: no cleanup at all
    return original_backward(self, loss, **kwargs)

accelerate.Accelerator.backward = backward

def run(where):
    (BASE / where).mkdir(exist_ok=True)
    os.chdir(BASE / where)
    losses.clear()
    namespace = {{"__name__": "__main__"}}
    exec(BLOCK, namespace)
    model = namespace["accelerator"].unwrap_model(namespace["model"])
    weights = {{k: hashlib.sha256(v.detach().cpu().numpy().tobytes()).hexdigest()
               for k, v in model.state_dict().items()}}
    info = namespace["info"]
    result = {{"losses": list(losses), "weights": weights,
              "resumed_at": info.step if info else None, "step": namespace["step"]}}
    (BASE / f"{{where}}.json").write_text(json.dumps(result))

if MODE == "reference+crash":
    run("reference")
    run("interrupted")
    raise SystemExit("the armed SIGKILL did not fire")
run("interrupted")  # MODE == "resume"
"""


def _harness(mode: str, kill_at: int | None = None) -> str:
    block = readme_block("### Accelerate")
    return HARNESS.format(block=block, mode=mode, kill_at=kill_at)


def test_the_readme_accelerate_example_resumes_bit_identically_after_sigkill(tmp_path: Path):
    # 8 batches an epoch, saves every 5: killed in step 13, resumed at step 10, mid-epoch.
    crashed = run_example(_harness("reference+crash", kill_at=13), tmp_path)
    assert_killed(crashed)
    resumed = run_example(_harness("resume"), tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    reference = json.loads((tmp_path / "reference.json").read_text())
    result = json.loads((tmp_path / "interrupted.json").read_text())
    assert reference["resumed_at"] is None and reference["step"] == 24
    assert result["resumed_at"] == 10 and result["step"] == 24
    assert result["losses"] == reference["losses"][10:]  # steps 11..24, every bit
    assert result["weights"] == reference["weights"]
    assert pickled_files(tmp_path) == []


# -- in-process runs: fresh objects after an interruption -------------------------------

BATCHES, EPOCHS = 11, 3  # 44 samples, 4 a batch; the last step of an epoch syncs


class _Interrupted(Exception):
    pass


class Counter:
    """A custom object registered for checkpointing: restored in place."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def _train(
    root: Path,
    stateful: bool,
    interrupt_at: int | None = None,
    save_every: int = 1,
    resume_step: int | None = None,
) -> dict[str, Any]:
    set_seed(0)
    loading = DataLoaderConfiguration(use_seedable_sampler=True, use_stateful_dataloader=stateful)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, dataloader_config=loading)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(16, 1)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    inputs = torch.randn(44, 8, generator=torch.Generator().manual_seed(1))
    targets = torch.randn(44, 1, generator=torch.Generator().manual_seed(2))
    data = torch.utils.data.TensorDataset(inputs, targets)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    counter, progress = Counter(), {"samples": 0}
    accelerator.register_for_checkpointing(counter)
    losses: dict[int, float] = {}
    with cv.CheckpointManager(root / "store", run_id="accelerate-test") as manager:
        ckpt = Checkpointer(accelerator, manager, extra={"progress": progress})
        info = ckpt.load_state(step=resume_step)
        step = info.step if info else 0
        torch.rand(3)  # a probe before training draws from the global RNG
        for epoch in range(step // len(loader), EPOCHS):
            for x, y in ckpt.skip_first_batches(loader, step - epoch * len(loader)):
                with accelerator.accumulate(model):
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                step += 1
                counter.seen += 1
                progress["samples"] += len(x)
                losses[step] = loss.item()
                if step % save_every == 0:
                    # Some saves fall between two micro-batches of one step.
                    ckpt.save_state(step, include_grads=True)
                if step == interrupt_at:
                    raise _Interrupted(step)
    weights = accelerator.unwrap_model(model).state_dict()
    return {
        "losses": losses,
        "weights": {k: v.detach().clone() for k, v in weights.items()},
        "resumed_at": info.step if info else None,
        "counter": counter.seen,
        "progress": dict(progress),
    }


class _Runs:
    """Per data loader kind, made once: an uninterrupted run, and the store of a run
    interrupted after step 25 that saved after every step."""

    def __init__(self, factory: pytest.TempPathFactory) -> None:
        self.factory = factory
        self.references: dict[bool, dict[str, Any]] = {}
        self.stores: dict[bool, Path] = {}

    def reference(self, stateful: bool) -> dict[str, Any]:
        if stateful not in self.references:
            root = self.factory.mktemp("reference")
            self.references[stateful] = _train(root, stateful, save_every=BATCHES * EPOCHS)
        return self.references[stateful]

    def interrupted(self, stateful: bool) -> Path:
        if stateful not in self.stores:
            root = self.factory.mktemp("interrupted")
            with pytest.raises(_Interrupted):
                _train(root, stateful, interrupt_at=25)
            self.stores[stateful] = root / "store"
        return self.stores[stateful]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> _Runs:
    return _Runs(tmp_path_factory)


@pytest.mark.parametrize(
    ("stateful", "resume_step", "resumed_at"),
    [
        pytest.param(False, None, 25, id="newest-mid-epoch"),
        pytest.param(False, 22, 22, id="after-the-last-batch-of-an-epoch"),
        pytest.param(False, 12, 12, id="mid-gradient-accumulation"),
        pytest.param(True, None, 25, id="stateful-loader-newest-mid-epoch"),
        pytest.param(True, 22, 22, id="stateful-loader-after-the-last-batch-of-an-epoch"),
    ],
)
def test_a_resumed_accelerate_loop_continues_bit_identically(
    tmp_path: Path, runs: _Runs, stateful: bool, resume_step: int | None, resumed_at: int
):
    reference = runs.reference(stateful)
    shutil.copytree(runs.interrupted(stateful), tmp_path / "store")
    result = _train(tmp_path, stateful, save_every=5, resume_step=resume_step)

    assert result["resumed_at"] == resumed_at
    assert sorted(result["losses"]) == list(range(resumed_at + 1, BATCHES * EPOCHS + 1))
    for step, loss in result["losses"].items():
        assert loss == reference["losses"][step], step
    for name, tensor in result["weights"].items():
        assert torch.equal(tensor, reference["weights"][name]), name
    assert result["counter"] == reference["counter"] == BATCHES * EPOCHS
    assert result["progress"] == reference["progress"] == {"samples": 44 * EPOCHS}
    assert pickled_files(tmp_path) == []


def test_an_empty_store_is_a_fresh_start_and_extra_names_may_not_clash(tmp_path: Path):
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    with cv.CheckpointManager(tmp_path / "store", run_id="accelerate-test") as manager:
        before = model.weight.detach().clone()
        assert Checkpointer(accelerator, manager).load_state() is None
        assert torch.equal(model.weight, before)
        with pytest.raises(UsageError, match="model"):
            Checkpointer(accelerator, manager, extra={"model": {}})
