"""Restore a state in a process of its own and report its peak memory.

``python in_place_worker.py save|restore|restore_in_place STORE OUT`` (``OUT``: a JSON
file). The state: a module of large linear layers, its AdamW optimizer after one
step, a plain tensor and a counter, about ``MB`` megabytes in all (set by
``IN_PLACE_MB``). ``save`` saves it (step 1); the restores build the same objects
afresh (other values), restore once a tiny warm-up store (so that what a first
restore imports is loaded), then reset the resident set's peak (``VmHWM``, through
``/proc/self/clear_refs``) and restore ``STORE``: the report says how far the
resident set rose above where it stood before, and whether every value came back.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

import ckptvault as cv

MB = int(os.environ.get("IN_PLACE_MB", "64"))
WIDTH = 1024


def build(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    # Model and AdamW's two moments: 3 x 4 bytes per weight; a quarter in a plain tensor.
    layers = max(1, MB * 2**20 * 3 // 4 // (12 * WIDTH * WIDTH))
    model = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.randn(2, WIDTH)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    plain = torch.randn(MB * 2**20 // 4 // 4 // WIDTH, WIDTH)
    return {"model": model, "optim": optimizer, "plain": plain, "meta": {"seed": seed}}


def values(state: dict[str, Any]) -> list[torch.Tensor]:
    optimizer = state["optim"]
    moments = [t for s in optimizer.state.values() for t in s.values()]
    return [*state["model"].state_dict().values(), *moments, state["plain"]]


def status_kib(name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise LookupError(name)


def restore(store: str, in_place: bool) -> dict[str, Any]:
    expected = values(build(1))  # what was saved
    state = build(2)
    size = sum(t.numel() * t.element_size() for t in values(state))
    warm = Path(store).parent / f"warm-{in_place}"
    with cv.CheckpointManager(warm, run_id="warm") as mgr:
        mgr.save(1, {"x": torch.ones(100_000)})
        mgr.restore({"x": torch.zeros(100_000)}, in_place=in_place)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM := VmRSS
    before = status_kib("VmRSS")
    with cv.CheckpointManager(store, run_id="state") as mgr:
        info = mgr.restore(state, in_place=in_place)
    peak = status_kib("VmHWM")
    assert info is not None
    exact = all(torch.equal(a, b) for a, b in zip(values(state), expected, strict=True))
    return {
        "state": size,
        "rss_before": before * 1024,
        "extra": (peak - before) * 1024,
        "exact": exact and state["meta"] == {"seed": 1},
    }


def main() -> None:
    mode, store, out = sys.argv[1:4]
    if mode == "save":
        with cv.CheckpointManager(store, run_id="state") as mgr:
            mgr.save(1, build(1))
        report: dict[str, Any] = {}
    else:
        report = restore(store, in_place=mode == "restore_in_place")
    Path(out).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
