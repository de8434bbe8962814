"""The tensor-count axis: N tensors of 256 float32, saved and restored by each contender.

Two layouts of the same tensors:

- ``flat``: a plain ``{name: tensor}`` dict;
- ``module``: ``{"model": module}`` holding N/2 ``LayerNorm(256)`` (the per-layer norms
  and biases of a real model) nested at most 32 to a module, saved through
  ``state_dict()`` and restored with ``load_state_dict`` (DCP: into the module's own
  ``state_dict()`` tensors).

Every save is durable (fsync'd); every restore writes into tensors that already
exist, as a resumed job does: torch.load + ``copy_`` per tensor (``load_state_dict``
for a module), safetensors ``load_file`` + the same, DCP ``load`` in place,
ckptvault ``restore`` (which also verifies every byte). ckptvault's first save of
a layout may build caches: it is its own row (``ckptvault save (first)``), and the
``ckptvault save`` row is the second and later saves of one manager, one per point.
Each restore opens a fresh manager, as a restarted job does. On the disk the
files' pages are dropped before each restore (``posix_fadvise``); on tmpfs nothing
is cold and the figures are software alone.
"""

from __future__ import annotations

import gc
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import ckptvault as cv
from bench.measure import files_under, fsync_path, rotated, sync_all

warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")

WIDTH = 256  # float32 elements per tensor: 1 KiB, so per-tensor costs dominate
FAN_OUT = 32  # most direct children of one module in the module layout
LAYOUTS = ("flat", "module")
SAVES = ("torch.save+fsync", "safetensors save_file+fsync", "DCP save", "ckptvault save")
RESTORES = ("torch.load+copy", "safetensors load_file+copy", "DCP load", "ckptvault restore")
FIRST_SAVE = "ckptvault save (first)"


# -- the states ------------------------------------------------------------------------


def tensor_names(count: int) -> list[str]:
    return [f"blocks.{i // 2}.norm.{('weight', 'bias')[i % 2]}" for i in range(count)]


def flat_state(count: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(WIDTH, generator=generator) for name in tensor_names(count)}


def _norm_tree(norms: int) -> torch.nn.Module:
    """``norms`` LayerNorms in a tree of fan-out at most ``FAN_OUT``."""
    if norms <= FAN_OUT:
        return torch.nn.ModuleList(torch.nn.LayerNorm(WIDTH) for _ in range(norms))
    step = -(-norms // FAN_OUT)
    sizes = [min(step, norms - start) for start in range(0, norms, step)]
    return torch.nn.ModuleList(_norm_tree(size) for size in sizes)


def module_state(count: int, seed: int) -> torch.nn.Module:
    """``count`` tensors as ``count / 2`` LayerNorms (a weight and a bias each), nested
    as real models nest layers, blocks and experts: at most ``FAN_OUT`` children per
    module. (``load_state_dict`` filters every key of a module's state at each of its
    children, so one module with thousands of direct children makes it quadratic:
    5,000 LayerNorms in one ``Sequential`` take it ~10 s. That is torch's cost, in
    every contender's restore alike, and would hide what this benchmark measures.)"""
    model = _norm_tree(count // 2)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(WIDTH, generator=generator))
    return model


@dataclass
class Pair:
    """The state a point saves (``source``) and the one restores write into."""

    layout: str
    source: Any  # a dict of tensors, or a module
    target: Any

    def tensors(self, which: Any) -> dict[str, torch.Tensor]:
        return which if self.layout == "flat" else which.state_dict()

    def vault_state(self, which: Any) -> dict[str, Any]:
        return which if self.layout == "flat" else {"model": which}

    def payload(self) -> dict[str, Any]:
        """What torch.save and DCP save: the dict, or ``{"model": state_dict()}``."""
        return self.source if self.layout == "flat" else {"model": self.source.state_dict()}

    def apply(self, loaded: dict[str, torch.Tensor]) -> None:
        """``load_state_dict``-like: copy every loaded tensor into the target."""
        if self.layout == "module":
            self.target.load_state_dict(loaded)
            return
        target = self.target
        for name, value in loaded.items():
            target[name].copy_(value)

    def spoil(self) -> None:
        """Zero a few target tensors, so a restore that did nothing is caught."""
        with torch.no_grad():
            for name in self._sampled():
                self.tensors(self.target)[name].zero_()

    def check(self, who: str) -> None:
        source, target = self.tensors(self.source), self.tensors(self.target)
        for name in self._sampled():
            if not torch.equal(source[name], target[name]):
                raise AssertionError(f"{who} did not restore {name}")

    def _sampled(self) -> list[str]:
        names = list(self.tensors(self.source))
        return [names[0], names[len(names) // 2], names[-1]]


def make_pair(layout: str, count: int) -> Pair:
    if layout == "flat":
        return Pair(layout, flat_state(count, 0), flat_state(count, 1))
    return Pair(layout, module_state(count, 0), module_state(count, 1))


# -- the contenders --------------------------------------------------------------------


def torch_save(pair: Pair, path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(pair.payload(), handle)
        handle.flush()
        os.fsync(handle.fileno())


def torch_restore(pair: Pair, path: Path) -> None:
    loaded = torch.load(path, weights_only=True)
    pair.apply(loaded if pair.layout == "flat" else loaded["model"])


def safetensors_save(pair: Pair, path: Path) -> None:
    save_file(pair.tensors(pair.source), str(path))
    fsync_path(path)


def safetensors_restore(pair: Pair, path: Path) -> None:
    pair.apply(load_file(str(path)))


def dcp_save(pair: Pair, path: Path) -> None:
    writer = dcp.FileSystemWriter(str(path), sync_files=True)
    dcp.save(pair.payload(), storage_writer=writer, no_dist=True)


def dcp_restore(pair: Pair, path: Path) -> None:
    """DCP loads into the tensors it is given: the target's own."""
    target = pair.target if pair.layout == "flat" else {"model": pair.target.state_dict()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)


@dataclass
class Vault:
    """One ckptvault store per point: a manager kept open, so that measured saves are
    the second and later saves of one layout; restores through a fresh manager."""

    root: Path
    manager: cv.CheckpointManager | None = None
    step: int = 0
    first_save: float = 0.0

    def open(self, pair: Pair) -> None:
        """The manager, and its first save of this layout (timed on its own)."""
        self.manager = cv.CheckpointManager(self.root, run_id="scale")
        self.first_save = clock(lambda: self.save(pair, self.root))

    def save(self, pair: Pair, _path: Path) -> None:
        assert self.manager is not None, "open() first"
        self.step += 1
        self.manager.save(self.step, pair.vault_state(pair.source))

    def restore(self, pair: Pair, _path: Path) -> None:
        with cv.CheckpointManager(self.root, run_id="scale") as reader:
            info = reader.restore(pair.vault_state(pair.target))
        assert info is not None and info.step == self.step

    def close(self) -> None:
        if self.manager is not None:
            self.manager.close()
        shutil.rmtree(self.root, ignore_errors=True)


# -- measuring -------------------------------------------------------------------------


def clock(fn: Callable[[], object]) -> float:
    gc.collect()
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def drop_pages(path: Path) -> None:
    """Evict ``path``'s pages (it was fsync'd), so the restore reads the disk."""
    for file in files_under(path):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


Action = Callable[[Pair, Path], None]


@dataclass
class Point:
    """Everything measured at one tensor count: (fs, layout, row) -> seconds."""

    count: int
    seconds: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)

    def add(self, fs: str, layout: str, row: str, value: float) -> None:
        self.seconds.setdefault((fs, layout, row), []).append(value)


def _contenders(vault: Vault) -> list[tuple[str, str, str, Action, Action]]:
    """(save row, restore row, file name, save, restore) for each contender."""
    return [
        (SAVES[0], RESTORES[0], "torch.pt", torch_save, torch_restore),
        (SAVES[1], RESTORES[1], "st.safetensors", safetensors_save, safetensors_restore),
        (SAVES[2], RESTORES[2], "dcp", dcp_save, dcp_restore),
        (SAVES[3], RESTORES[3], "vault", vault.save, vault.restore),
    ]


def _round(point: Point, fs: str, root: Path, pair: Pair, vault: Vault) -> None:
    """Every contender once, in a rotated order: save, then restore what it saved."""
    cold = fs == "disk"
    for save_row, restore_row, name, save, restore in rotated(_contenders(vault)):
        path = vault.root if save_row == SAVES[3] else root / name
        if path != vault.root:
            remove(path)
        point.add(fs, pair.layout, save_row, clock(lambda: save(pair, path)))  # noqa: B023
        sync_all()
        if cold:
            drop_pages(path)
        pair.spoil()
        point.add(fs, pair.layout, restore_row, clock(lambda: restore(pair, path)))  # noqa: B023
        pair.check(restore_row)
        if path != vault.root:
            remove(path)


def measure_count(count: int, roots: dict[str, Path], layouts: tuple[str, ...], reps: int) -> Point:
    """``reps`` interleaved rounds of every contender, on every filesystem in
    ``roots`` (name -> scratch directory) and every layout."""
    point = Point(count)
    pairs = {layout: make_pair(layout, count) for layout in layouts}
    configs = [(fs, layout) for fs in roots for layout in layouts]
    vaults = {(fs, lay): Vault(roots[fs] / f"vault-{lay}-{count}") for fs, lay in configs}
    try:
        for (_fs, layout), vault in vaults.items():
            vault.open(pairs[layout])
        for _rep in range(reps):
            for fs, layout in rotated(configs):
                _round(point, fs, roots[fs], pairs[layout], vaults[fs, layout])
        for (fs, layout), vault in vaults.items():
            point.add(fs, layout, FIRST_SAVE, vault.first_save)
    finally:
        for vault in vaults.values():
            vault.close()
    return point
