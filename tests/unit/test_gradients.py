"""Saves in the middle of gradient accumulation: warned about, refused under
strict=True, or saved with include_grads=True and resumed exactly."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import UsageError


def setup(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}


def microbatch(state: dict, index: int) -> None:
    """One microbatch's backward: gradients accumulate in .grad."""
    generator = torch.Generator().manual_seed(index)
    x = torch.randn(16, 4, generator=generator)
    (state["model"](x).square().mean() / 2).backward()


def full_step(state: dict, step: int) -> None:
    state["optimizer"].zero_grad(set_to_none=True)
    microbatch(state, 2 * step)
    microbatch(state, 2 * step + 1)
    state["optimizer"].step()


def manager(store: Path) -> cv.CheckpointManager:
    return cv.CheckpointManager(store, run_id="grads")


def test_a_save_after_the_optimizer_step_says_nothing(store, caplog):
    state = setup()
    with caplog.at_level(logging.WARNING, logger="ckptvault"), manager(store) as mgr:
        mgr.restore(state)
        for step in range(3):
            full_step(state, step)  # grads stay in .grad after step(): applied, not pending
            mgr.save(step, state)
        state["optimizer"].zero_grad(set_to_none=False)  # zeroed in place: nothing pending
        mgr.save(3, state)
    assert "between backward() and optimizer.step()" not in caplog.text


def test_a_save_mid_accumulation_is_warned_about_naming_the_parameters(store, caplog):
    state = setup()
    with caplog.at_level(logging.WARNING, logger="ckptvault"), manager(store) as mgr:
        mgr.restore(state)
        full_step(state, 0)
        state["optimizer"].zero_grad(set_to_none=True)
        microbatch(state, 2)  # half of the next step's gradient
        mgr.save(1, state)
    assert "the save of step 1 comes between backward() and optimizer.step()" in caplog.text
    assert "model.0.weight" in caplog.text and "include_grads=True" in caplog.text


def test_strict_refuses_a_save_mid_accumulation_before_writing(store):
    state = setup()
    with manager(store) as mgr:
        mgr.restore(state)
        full_step(state, 0)
        mgr.save(0, state, strict=True)  # after the step: fine
        microbatch(state, 2)  # accumulates on top of the applied gradient
        with pytest.raises(UsageError, match="strict=True refuses it"):
            mgr.save(1, state, strict=True)
        assert [g.step for g in mgr.generations()] == [0]


def test_include_grads_resumes_mid_accumulation_exactly(store):
    reference = setup()
    for step in range(3):
        full_step(reference, step)

    interrupted = setup()
    with manager(store) as mgr:
        mgr.restore(interrupted)
        full_step(interrupted, 0)
        full_step(interrupted, 1)
        interrupted["optimizer"].zero_grad(set_to_none=True)
        microbatch(interrupted, 4)  # first microbatch of step 2, then the "crash"
        mgr.save(2, interrupted, include_grads=True)

    resumed = setup(seed=1)
    with manager(store) as mgr:
        info = mgr.restore(resumed)
    assert info is not None and info.step == 2
    assert "__ckptvault_gradients__" not in resumed  # the slot was only borrowed
    assert torch.equal(resumed["model"][0].weight.grad, interrupted["model"][0].weight.grad)
    microbatch(resumed, 5)  # the second microbatch, then the step
    resumed["optimizer"].step()
    for live, expected in zip(
        resumed["model"].parameters(), reference["model"].parameters(), strict=True
    ):
        assert torch.equal(live, expected)
