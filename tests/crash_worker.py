"""A save loop for the crash-safety test (run as a script, killed with SIGKILL).

    python crash_worker.py STORE

Restores the newest valid generation (printing ``restored STEP``, -1 for none), then
trains and saves every step forever, printing ``saved STEP`` after each ``save``
returns.
"""

from __future__ import annotations

import sys

import torch

import ckptvault as cv


def main() -> None:
    torch.manual_seed(0)
    # Large enough (12 MB with AdamW) that writing dominates a save's fixed costs (the
    # catalog, the events), so most random kills land inside a save.
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 256)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"model": model, "optimizer": opt, "rng": cv.RNGState(), "meta": {"step": -1}}
    # Retention keeps the store small however many kills a long run makes (so checking
    # it stays cheap), and puts deletions among the moments a kill can land.
    keep = cv.Retention(keep_last=4, delete_delay=0)
    with cv.CheckpointManager(sys.argv[1], run_id="crash", retention=keep) as mgr:
        info = mgr.restore(state)
        restored = info.step if info else -1
        assert state["meta"]["step"] == restored
        print(f"restored {restored}", flush=True)
        step = restored
        while True:
            step += 1
            opt.zero_grad()
            model(torch.randn(8, 256)).square().mean().backward()
            opt.step()
            state["meta"]["step"] = step
            mgr.save(step, state)
            print(f"saved {step}", flush=True)


if __name__ == "__main__":
    main()
