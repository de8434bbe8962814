"""A small training run for the bit-exact resume test (run as a script).

    python resume_worker.py full   STORE STEPS EVERY OUT SEED
    python resume_worker.py resume STORE STEPS FROM  OUT SEED

``full`` trains from scratch, saving every EVERY steps; ``resume`` builds fresh
objects (seeded with SEED, deliberately different), restores the generation of step
FROM and continues. Each step appends one JSON record to OUT: loss (hex), batch
indices, dropout-mask digest, learning rate, weights and optimizer digests, and the
draws from Python ``random`` and NumPy's global RNG.
"""

from __future__ import annotations

import json
import os
import random
import sys

# Same kernels, same bits (see demo/train.py): MKL's reproducible mode, set before
# torch (and so MKL) is imported.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import numpy as np
import torch
from blake3 import blake3

import ckptvault as cv

# ... and a pinned thread count (see demo/train.py, pin_threads).
torch.set_num_threads(torch.get_num_threads())

DATA = torch.linspace(-1, 1, 256 * 6).reshape(256, 6)
TARGET = DATA.sum(dim=1, keepdim=True).sin()


def digest(tensors) -> str:
    hasher = blake3()
    for tensor in tensors:
        hasher.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def build(seed: int):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 32), torch.nn.Dropout(0.3), torch.nn.ReLU(), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    state = {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "batch_rng": np.random.default_rng(seed + 1),
        "rng": cv.RNGState(),
        "meta": {"next_step": 0},
    }
    return state


def train(state, steps: int, out, mgr=None, every: int = 0) -> None:
    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    masks: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda m, i, o: masks.append((o != 0).to(torch.uint8)))
    while state["meta"]["next_step"] < steps:
        step = state["meta"]["next_step"]
        indices = state["batch_rng"].choice(len(DATA), size=16, replace=False)
        noise_scale = random.random() * 0.01  # Python random
        jitter = float(np.random.normal())  # NumPy's global RNG
        x = DATA[indices] + noise_scale * torch.randn(16, 6)  # torch CPU RNG
        masks.clear()
        opt.zero_grad(set_to_none=True)
        loss = (model(x) - TARGET[indices]).square().mean() * (1 + 0.001 * jitter)
        loss.backward()
        opt.step()
        sched.step()
        state["meta"]["next_step"] = step + 1
        optimizer_tensors = [
            v for entry in opt.state_dict()["state"].values() for v in entry.values()
        ]
        record = {
            "step": step,
            "loss": loss.item().hex(),
            "indices": indices.tolist(),
            "mask": digest(masks),
            "lr": sched.get_last_lr()[0].hex(),
            "weights": digest(model.parameters()),
            "optimizer": digest(optimizer_tensors),
            "draws": [noise_scale.hex(), jitter.hex()],
        }
        out.write(json.dumps(record) + "\n")
        if mgr is not None and every and (step + 1) % every == 0:
            mgr.save(step, state)


def main() -> None:
    mode, store, steps, k, out_path, seed = sys.argv[1:7]
    steps, k, seed = int(steps), int(k), int(seed)
    state = build(seed)
    with open(out_path, "w") as out:
        if mode == "full":
            with cv.CheckpointManager(store, run_id="exact") as mgr:
                train(state, steps, out, mgr, every=k)
        else:
            with cv.CheckpointManager(store, run_id="exact") as mgr:
                info = mgr.restore(state, step=k)
                assert info is not None and info.step == k
            train(state, steps, out)


if __name__ == "__main__":
    main()
