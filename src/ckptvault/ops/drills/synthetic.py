"""The small training run drills use when they have no model of their own.

``ckptvault drill --synthetic`` builds a run from it, the SIGKILL drill's save loop
and the supervised drill's training script train it. It is small (about 3 MiB per
generation: an MLP and AdamW's two moments) so that drills take seconds, and
deterministic, so that a restored run can be compared with the saved one.
"""

from __future__ import annotations

from typing import Any

import torch

import ckptvault as cv

WIDTH = 256  # Linear(256, 512) + Linear(512, 256): about 1 MiB of fp32 parameters


def build_state(seed: int = 0) -> dict[str, Any]:
    """Fresh live objects (model, AdamW with its moments, RNG, counters) to save or
    to restore into: the same layout every time, values depending on ``seed``."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.ReLU(), torch.nn.Linear(2 * WIDTH, WIDTH)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state: dict[str, Any] = {
        "model": model,
        "optimizer": optimizer,
        "rng": cv.RNGState(),
        "meta": {"step": -1},
    }
    train_step(state)  # creates Adam's moments: the layout every save will have
    state["meta"]["step"] = -1
    return state


def train_step(state: dict[str, Any]) -> float:
    """One optimizer step on random data; returns the loss (finite)."""
    model, optimizer = state["model"], state["optimizer"]
    optimizer.zero_grad(set_to_none=True)
    loss = model(torch.randn(8, WIDTH)).square().mean()
    loss.backward()
    optimizer.step()
    state["meta"]["step"] += 1
    return float(loss.detach())


def ballast_state(nbytes: int) -> dict[str, Any]:
    """A plain state of about ``nbytes`` (a store whose model the drill does not have)."""
    return {"ballast": torch.zeros(max(1, nbytes // 4), dtype=torch.float32), "meta": {"step": 0}}
