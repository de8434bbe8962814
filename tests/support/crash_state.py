"""The crash harness's training state: every bit of it a function of the step.

A worker fills the state for step N just before ``save(N, state)``; a checker in a
fresh process restores into a blank state and recomputes what step N must hold, so
"the restored state is exactly what was saved at that step" is checked bit for bit
without keeping copies. Every part carries the step (weights, AdamW moments and its
step count, a large ballast tensor, JSON leaves, the global RNGs), so a generation
that mixed bytes of two saves, or lost one file, cannot pass.

With ``world > 1`` the weight is a DTensor sharded by rows over the ranks (built from
each rank's local rows, no collective) and the RNGs are per rank.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

import ckptvault as cv

WIDTH = 256  # the model: Linear(WIDTH, 4*WIDTH) -> Linear(4*WIDTH, WIDTH), 2 MiB of weights
ROWS, COLS = 64, 1024  # the sharded weight of a multi-rank job: 256 KiB
_BASE: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}


def _base(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A fixed random tensor per name (seeded by the name), made once per process."""
    key = (name, shape)
    if key not in _BASE:
        seed = sum(ord(c) * 31**i for i, c in enumerate(name)) % 2**31
        _BASE[key] = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return _BASE[key]


def expected(name: str, shape: tuple[int, ...], step: int) -> torch.Tensor:
    """What tensor ``name`` holds at ``step``: exact in float32 for the steps a run reaches."""
    return _base(name, shape) + float(step)


def _rng_seed(step: int, rank: int) -> int:
    return step * 16 + rank


def build(ballast_mb: int, sharded: bool = False, world: int = 1) -> dict[str, Any]:
    """A blank state of the harness's layout (values are set by :func:`fill`).

    ``sharded`` adds the multi-rank job's weight: a DTensor over ``world`` ranks, or a
    plain tensor on one process (restoring a multi-rank generation there).
    """
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.ReLU(), torch.nn.Linear(4 * WIDTH, WIDTH)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for parameter in model.parameters():  # create AdamW's moments (and its step count)
        parameter.grad = torch.zeros_like(parameter)
    optimizer.step()
    state: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "ballast": torch.zeros(max(ballast_mb, 0) * 262144),
        "rng": cv.RNGState(),
        "meta": {"step": -1, "tokens_seen": 0, "name": ""},
    }
    if sharded and world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard

        mesh = init_device_mesh("cpu", (world,))
        local = torch.zeros(ROWS // world, COLS)
        state["sharded"] = {"w": DTensor.from_local(local, mesh, [Shard(0)], run_check=False)}
    elif sharded:
        state["sharded"] = {"w": torch.zeros(ROWS, COLS)}
    return state


def _local_rows(state: dict[str, Any], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The sharded weight's local tensor on this rank, and the row indices it holds."""
    weight = state["sharded"]["w"]
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    rows = local.shape[0]
    return local, torch.arange(rank * rows, (rank + 1) * rows)


def _tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of the state by a stable name (the whole, unsharded view)."""
    model, optimizer = state["model"], state["optimizer"]
    named = {f"p.{k}": p.data for k, p in model.named_parameters()}
    for index, parameter in enumerate(model.parameters()):
        for key, value in optimizer.state[parameter].items():
            if value.dim() > 0:
                named[f"o.{index}.{key}"] = value
    named["ballast"] = state["ballast"]
    return named


def fill(state: dict[str, Any], step: int, rank: int = 0) -> None:
    """Set every part of ``state`` to its value at ``step`` (RNGs last)."""
    for name, tensor in _tensors(state).items():
        tensor.copy_(expected(name, tuple(tensor.shape), step))
    for parameter in state["model"].parameters():
        state["optimizer"].state[parameter]["step"].fill_(float(step))
    if "sharded" in state:
        local, rows = _local_rows(state, rank)
        local.copy_(expected("sharded", (ROWS, COLS), step)[rows])
    state["meta"].update(step=step, tokens_seen=1000 * step, name=f"step {step}")
    seed = _rng_seed(step, rank)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _draws() -> list[float]:
    return [random.random(), float(np.random.random()), float(torch.rand(1))]


def mismatches(state: dict[str, Any], step: int, rank: int = 0, rng: bool = True) -> list[str]:
    """What in a restored ``state`` differs from step ``step`` (empty: bit-exact).

    ``rng``: also check the global RNGs (not after a restore onto another world size,
    which leaves per-rank entries as they were). Draws from the RNGs when checked.
    """
    wrong = [
        name
        for name, tensor in _tensors(state).items()
        if not torch.equal(tensor, expected(name, tuple(tensor.shape), step))
    ]
    for index, parameter in enumerate(state["model"].parameters()):
        if float(state["optimizer"].state[parameter]["step"]) != float(step):
            wrong.append(f"o.{index}.step")
    if "sharded" in state:
        local, rows = _local_rows(state, rank)
        if not torch.equal(local, expected("sharded", (ROWS, COLS), step)[rows]):
            wrong.append("sharded")
    if state["meta"] != {"step": step, "tokens_seen": 1000 * step, "name": f"step {step}"}:
        wrong.append(f"meta {state['meta']}")
    if rng:
        restored = _draws()
        seed = _rng_seed(step, rank)
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
        if restored != _draws():
            wrong.append("rng")
    return wrong
