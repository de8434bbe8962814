"""PyTorch Lightning through ``CkptvaultCheckpointIO``: real Trainers, real fits.

A run interrupted (its Trainer stops at step 5, mid-epoch) and resumed by a fresh
Trainer and a freshly initialized module from ``ckpt_path="last"`` ends bit-identical
to an uninterrupted run, with the same loss at every step, while every pickle entry
point and ``torch.save``/``torch.load`` are patched to raise; no file the runs leave
is a pickle or a torch zip. The dict ``load_checkpoint`` returns is the one Lightning
saved: keys, order, types, tensors. What the codec cannot store is refused naming
its key; checkpoints Lightning removes leave the store through ckptvault's retention
(the safety net keeps a verified fallback); the documented example runs as written.
The plugin called directly: ``test_integration_lightning_io.py``.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import re
import struct
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import UnsupportedValueError
from support.doc_pages import python_block_after, section

pl = pytest.importorskip("lightning.pytorch")
stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from ckptvault.integrations.lightning import CkptvaultCheckpointIO  # noqa: E402

STEPS, INTERRUPT_AT, SAMPLES, BATCH = 12, 5, 32, 4  # 8 batches an epoch: stops mid-epoch


class Regression(pl.LightningModule):
    """Dropout draws from the global RNG, which Lightning does not checkpoint: the
    module carries it through ``on_save_checkpoint`` (a tensor in the dict)."""

    def __init__(self, lr: float = 0.02, name: str = "tiny", **extra: Any) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
        )
        self.losses: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3)}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["torch_rng"] = torch.get_rng_state()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        torch.set_rng_state(checkpoint["torch_rng"])


class EpochShuffle(torch.utils.data.Sampler):
    """A new permutation each epoch from (seed, epoch) alone: Lightning calls
    ``set_epoch``, and the stateful loader restores the position within the epoch."""

    def __init__(self, size: int, seed: int = 1) -> None:
        self.size, self.seed, self.epoch = size, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())


def _loader() -> Any:
    data = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, 4, generator=data), torch.randn(SAMPLES, 1, generator=data)
    )
    # The loader's own generator: its per-iterator seed draw must not touch the global
    # RNG, which the resumed run has already restored when the iterator is made.
    return stateful_dataloader.StatefulDataLoader(
        dataset,
        batch_size=BATCH,
        sampler=EpochShuffle(SAMPLES),
        generator=torch.Generator().manual_seed(5),
    )


def _trainer(plugin: CkptvaultCheckpointIO, dirpath: Path, max_steps: int, **checkpointing):
    options = {"every_n_train_steps": INTERRUPT_AT, "save_last": True, **checkpointing}
    return pl.Trainer(
        max_steps=max_steps,
        plugins=[plugin],
        callbacks=[ModelCheckpoint(dirpath=dirpath, **options)],
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=dirpath.parent,
    )


def _module(seed: int, **hparams: Any) -> Regression:
    torch.manual_seed(seed)
    return Regression(**hparams)


class RecordingIO(CkptvaultCheckpointIO):
    """Keeps a deep copy of every dict Lightning hands over, to compare with a load."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handed: dict[str, dict[str, Any]] = {}

    def save_checkpoint(self, checkpoint, path, storage_options=None) -> None:
        self.handed[os.fspath(path)] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


class PickleUsed(AssertionError):
    pass


def _refuse(*args: Any, **kwargs: Any) -> None:
    raise PickleUsed("pickle or torch.save/torch.load was used")


def _forbid_pickle(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every pickle entry point and torch.save/load raise, but one: Lightning probes
    its hyperparameters with ``pickle.dumps`` in memory (``is_picklable``) when a fit
    starts; those calls are let through and returned, nothing else is."""
    probes: list[str] = []
    dumps = pickle.dumps

    def probe(obj: Any, *args: Any, **kwargs: Any) -> bytes:
        caller = sys._getframe(1).f_code
        if caller.co_name != "is_picklable" or "lightning" not in caller.co_filename:
            raise PickleUsed(f"pickle.dumps called from {caller.co_filename}:{caller.co_name}")
        probes.append(caller.co_name)
        return dumps(obj, *args, **kwargs)

    for name in ("dump", "load", "loads", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, _refuse)
    monkeypatch.setattr(pickle, "dumps", probe)
    monkeypatch.setattr(torch, "save", _refuse)
    monkeypatch.setattr(torch, "load", _refuse)
    return probes


def _is_safetensors(data: bytes, size: int) -> bool:
    (header,) = struct.unpack("<Q", data[:8])
    return data[8:9] == b"{" and header + 8 <= size


def _pickles_or_torch_zips(root: Path) -> list[Path]:
    """Files that hold a pickle (protocol 2+ magic) or torch.save's zip format."""
    found = []
    for path in root.rglob("*"):
        if not path.is_file() or path.is_symlink():
            continue
        head = path.read_bytes()[:16]
        pickled = len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5
        if zipfile.is_zipfile(path) or (pickled and not _is_safetensors(head, path.stat().st_size)):
            found.append(path)
    return found


def _same(saved: Any, loaded: Any, where: str = "checkpoint") -> None:
    """Same structure, key order, types and values (tensors: dtype, shape, bytes)."""
    assert type(loaded) is type(saved), f"{where}: {type(loaded)} != {type(saved)}"
    if isinstance(saved, torch.Tensor):
        assert loaded.dtype == saved.dtype and torch.equal(loaded, saved), where
    elif isinstance(saved, dict):
        assert list(loaded) == list(saved), where
        for key in saved:
            _same(saved[key], loaded[key], f"{where}[{key!r}]")
    elif isinstance(saved, (list, tuple)):
        assert len(loaded) == len(saved), where
        for index, (a, b) in enumerate(zip(saved, loaded, strict=True)):
            _same(a, b, f"{where}[{index}]")
    else:
        assert loaded == saved, where


def test_an_interrupted_fit_resumes_bit_identically_without_pickle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    probes = _forbid_pickle(monkeypatch)
    torch.set_num_threads(1)  # one process, but the same kernels in both runs

    whole_io = RecordingIO(tmp_path / "store-whole", run_id="whole")
    whole = _module(seed=0)
    _trainer(whole_io, tmp_path / "whole", STEPS).fit(whole, _loader())

    first = _module(seed=0)
    first_trainer = _trainer(
        CkptvaultCheckpointIO(tmp_path / "store", run_id="r"), tmp_path / "ckpt", INTERRUPT_AT
    )
    first_trainer.fit(first, _loader())
    assert first_trainer.global_step == INTERRUPT_AT
    # A fresh Trainer, plugin and module (another init): everything comes from the store.
    resumed = _module(seed=123)
    second = _trainer(
        CkptvaultCheckpointIO(tmp_path / "store", run_id="r"), tmp_path / "ckpt", STEPS
    )
    second.fit(resumed, _loader(), ckpt_path="last")

    assert second.global_step == STEPS
    assert first.losses + resumed.losses == whole.losses
    assert len(whole.losses) == STEPS
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert _pickles_or_torch_zips(tmp_path) == []
    assert set(probes) == {"is_picklable"}  # Lightning's in-memory probe, nothing written

    # What load_checkpoint returns is what Lightning handed over, to the last key.
    last = tmp_path / "whole" / "last.ckpt"
    loaded = whole_io.load_checkpoint(last)
    _same(whole_io.handed[str(last)], loaded)
    assert loaded["state_dict"]._metadata == whole.state_dict()._metadata
    assert loaded["hyper_parameters"] == {"lr": 0.02, "name": "tiny"}
    whole_io.teardown()


def test_pointers_stand_at_lightnings_paths_and_removed_checkpoints_leave_the_store(
    tmp_path: Path,
):
    """save_top_k=1 with save_last="link": Lightning removes each older checkpoint and
    links last.ckpt; ckptvault deletes the removed generations but the newest and one
    verified fallback. A fresh Trainer resumes from an explicit path."""
    store, ckpt = tmp_path / "store", tmp_path / "ckpt"
    plugin = CkptvaultCheckpointIO(store, run_id="r")
    trainer = _trainer(plugin, ckpt, 8, every_n_train_steps=2, save_top_k=1, save_last="link")
    trainer.fit(_module(seed=0), _loader())

    # 6 was released by Lightning (a record in the store), kept by retention for now.
    names = sorted(p.name for p in ckpt.iterdir())
    assert names == ["epoch=0-step=8.ckpt", "last.ckpt"]
    assert os.readlink(ckpt / "last.ckpt") == "epoch=0-step=8.ckpt"
    # Reopened after the fit's teardown; 2 and 4 are deleted, 6 is the verified fallback.
    assert [g.step for g in plugin.manager.generations()] == [8, 6]
    plugin.teardown()  # 2 and 4 deleted; 6 is retention's verified fallback
    pointer = (ckpt / "epoch=0-step=8.ckpt").read_bytes()
    assert re.fullmatch(
        rb'\{"ckptvault_lightning":1,"generation_id":"[^"]+","run_id":"r",'
        rb'"step":8,"store":"[^"]+"\}',
        pointer,
    )

    resumed = _module(seed=9)
    again = _trainer(
        CkptvaultCheckpointIO(store, run_id="r"),
        ckpt,
        10,
        every_n_train_steps=2,
        save_top_k=1,
        save_last="link",
    )
    again.fit(resumed, _loader(), ckpt_path=str(ckpt / "epoch=0-step=8.ckpt"))
    assert again.global_step == 10 and len(resumed.losses) == 2
    with cv.CheckpointManager(store, run_id="r") as manager:  # 6 went in this process
        assert [g.step for g in manager.generations()] == [10, 8]


def test_an_unencodable_hyperparameter_is_refused_naming_its_key(tmp_path: Path):
    """A class among the hyperparameters cannot be stored without pickle: the fit
    stops at the first checkpoint with an error naming the key and the fix, and
    neither a generation nor a pointer is left behind."""
    plugin = CkptvaultCheckpointIO(tmp_path / "store", run_id="r")
    trainer = _trainer(plugin, tmp_path / "ckpt", 2, every_n_train_steps=1)
    with pytest.raises(UnsupportedValueError) as caught:
        trainer.fit(_module(seed=0, activation=torch.nn.GELU), _loader())
    assert caught.value.path == "checkpoint['hyper_parameters']['activation']"
    assert "save_hyperparameters(ignore=[...])" in str(caught.value)
    assert "checkpoint['hyper_parameters']['activation']" in str(caught.value)
    assert not (tmp_path / "ckpt").exists() or list((tmp_path / "ckpt").iterdir()) == []
    assert plugin.manager.generations() == []
    plugin.teardown()


def _readme_example() -> str:
    """The first python block of the docs' "PyTorch Lightning" section."""
    return python_block_after("PyTorch Lightning")


def test_the_readme_example_runs_and_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The documented block as written, twice in one directory: the second run resumes
    from last.ckpt (a pointer) and has nothing left to train."""
    monkeypatch.chdir(tmp_path)
    code = compile(_readme_example(), section("PyTorch Lightning").where, "exec")
    first: dict[str, Any] = {"__name__": "readme"}
    exec(code, first)
    assert first["trainer"].global_step == 40
    second: dict[str, Any] = {"__name__": "readme"}
    exec(code, second)
    assert second["trainer"].ckpt_path == str(tmp_path / "runs" / "lit" / "last.ckpt")
    assert second["trainer"].global_step == 40
    assert (tmp_path / "runs" / "lit" / "last.ckpt").read_bytes().startswith(b'{"ckptvault_')


def test_the_readme_example_stopped_mid_epoch_resumes_bit_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The documented block, stopped at step 30 (the save there is mid-epoch: 8 batches
    an epoch) and run again as written, ends with the weights of a run never stopped.
    (Tried as a new user would, the recipe differed by 1.99e-1: its loader restarted
    the epoch and its data was drawn anew each run.)"""
    example = _readme_example()
    assert example.count("max_steps=40") == 1

    def run(directory: Path, code: str) -> Any:
        directory.mkdir(exist_ok=True)
        monkeypatch.chdir(directory)
        scope: dict[str, Any] = {"__name__": "readme"}
        exec(compile(code, section("PyTorch Lightning").where, "exec"), scope)
        return scope["trainer"]

    whole = run(tmp_path / "whole", example).lightning_module.state_dict()
    stopped = run(tmp_path / "stopped", example.replace("max_steps=40", "max_steps=30"))
    assert stopped.global_step == 30
    again = run(tmp_path / "stopped", example)
    assert again.ckpt_path == str(tmp_path / "stopped" / "runs" / "lit" / "last.ckpt")
    after = again.lightning_module.state_dict()
    assert after.keys() == whole.keys() and all(torch.equal(after[k], whole[k]) for k in whole)


def test_save_last_points_at_the_generation_of_its_step(tmp_path: Path):
    """save_last=True saves the top-k file and last.ckpt at the same step: both point
    at one generation (the newcomer tour saw epoch=0-step=4.ckpt and last.ckpt each
    written in full), and last.ckpt still resumes."""
    store, ckpt = tmp_path / "store", tmp_path / "ckpt"
    plugin = CkptvaultCheckpointIO(store, run_id="r")
    trainer = _trainer(plugin, ckpt, 8, every_n_train_steps=4, save_top_k=-1)
    trainer.fit(_module(seed=0), _loader())
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "epoch=0-step=4.ckpt",
        "epoch=0-step=8.ckpt",
        "last.ckpt",
    ]
    assert [g.step for g in plugin.manager.generations()] == [8, 4]  # one each
    last = json.loads((ckpt / "last.ckpt").read_bytes())
    assert last == json.loads((ckpt / "epoch=0-step=8.ckpt").read_bytes())
    resumed = _module(seed=9)
    again = _trainer(CkptvaultCheckpointIO(store, run_id="r"), ckpt, 10, every_n_train_steps=4)
    again.fit(resumed, _loader(), ckpt_path=str(ckpt / "last.ckpt"))
    assert again.global_step == 10


def test_async_saves_resume_bit_identically_and_removals_keep_their_order(tmp_path: Path):
    """AsyncCkptvaultCheckpointIO: saves in Lightning's background thread, removals
    queued behind them. With plain AsyncCheckpointIO around the plugin, save_top_k=1
    left epoch=0-step=2.ckpt behind (removed before its save had written it), and its
    generation was never released. A fit stopped at step 6 and resumed ends as one
    never stopped."""
    from ckptvault.integrations.lightning_async import AsyncCkptvaultCheckpointIO

    whole = _module(seed=0)
    _trainer(CkptvaultCheckpointIO(tmp_path / "whole", run_id="r"), tmp_path / "w", 8).fit(
        whole, _loader()
    )

    store, ckpt = tmp_path / "store", tmp_path / "ckpt"
    plugin = AsyncCkptvaultCheckpointIO(store, run_id="r")
    stopped = _trainer(plugin, ckpt, 6, every_n_train_steps=2, save_top_k=1)
    stopped.fit(_module(seed=0), _loader())
    assert sorted(p.name for p in ckpt.iterdir()) == ["epoch=0-step=6.ckpt", "last.ckpt"]
    with cv.CheckpointManager(store, run_id="r") as manager:
        assert [g.step for g in manager.generations()] == [6, 4]  # 2 released, 4 fallback

    resumed = _module(seed=9)
    again = _trainer(AsyncCkptvaultCheckpointIO(store, run_id="r"), ckpt, 8, save_top_k=1)
    again.fit(resumed, _loader(), ckpt_path=str(ckpt / "last.ckpt"))
    assert again.global_step == 8
    expected, after = whole.state_dict(), resumed.state_dict()
    assert all(torch.equal(expected[k], after[k]) for k in expected)
