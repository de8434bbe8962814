"""Staging buffers made ready ahead of the first async save (``prepare``): the first
save allocates nothing, values are still those at the call, memory goes back."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

import ckptvault as cv
from ckptvault.io.host_memory import anonymous_buffer, fault_in

PAGE = 4096


def _rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 1024)).sum().backward()
    opt.step()  # the moments exist: the layout a save will copy
    return model, opt


def test_prepared_buffers_serve_the_first_saves_without_allocating(store: Path):
    model, opt = _trained()
    state = {"model": model, "optimizer": opt}
    with cv.CheckpointManager(store, run_id="r", async_save=True, max_in_flight=2) as mgr:
        mgr.prepare(state)
        mgr.save(1, state)  # waits for the preparation if it is still running
        prepared = mgr.stats.staging_allocations
        tensors = 4 + 3 * 4  # weights and biases; AdamW's step and two moments of each
        assert prepared == 2 * tensors  # both slots (max_in_flight=2) were made ready
        with torch.no_grad():
            model[0].weight.add_(1.0)
        expected = model[0].weight.detach().clone()
        mgr.save(2, state)
        with torch.no_grad():
            model[0].weight.zero_()  # training moves on at once
        mgr.wait()
        assert mgr.stats.staging_allocations == prepared
        target_model, target_opt = _trained()
        mgr.restore({"model": target_model, "optimizer": target_opt})
    assert torch.equal(target_model[0].weight, expected)


def test_a_layout_change_after_prepare_still_saves_the_new_layout(store: Path):
    model, _ = _trained()
    with cv.CheckpointManager(store, run_id="r", async_save=True) as mgr:
        mgr.prepare({"model": model})
        bigger = torch.nn.Linear(1024, 1024)
        mgr.save(1, {"model": bigger}).result()
        target = torch.nn.Linear(1024, 1024)
        mgr.restore({"model": target})
    assert torch.equal(target.weight, bigger.weight)


def test_close_stops_a_preparation_in_progress(store: Path):
    state = {f"t{i}": torch.ones(1 << 20) for i in range(64)}  # 256 MiB to prepare
    mgr = cv.CheckpointManager(store, run_id="r", async_save=True)
    mgr.prepare(state)
    mgr.close()
    assert not [t for t in threading.enumerate() if t.name == "ckptvault-staging-prepare"]


def test_a_large_buffer_is_its_own_mapping_and_returns_to_the_system():
    before = _rss()
    buffer = anonymous_buffer((64 << 20,), torch.uint8)
    view = buffer.view(torch.float32)[:16]
    fault_in(buffer)
    assert _rss() - before > 60 << 20  # resident now, before any copy into it
    view.copy_(torch.arange(16, dtype=torch.float32))
    assert torch.equal(buffer[:64].view(torch.float32), torch.arange(16, dtype=torch.float32))
    del buffer
    assert _rss() - before > 60 << 20  # a live view keeps the mapping
    del view
    assert _rss() - before < 8 << 20  # unmapped with its last view


def test_small_buffers_take_ordinary_allocations():
    small = anonymous_buffer((3, 5), torch.bfloat16)
    assert small.shape == (3, 5) and small.dtype == torch.bfloat16
    fault_in(small)  # harmless on ordinary memory
