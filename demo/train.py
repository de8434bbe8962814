"""The demo's training job: a small model trained with periodic checkpoints.

    python demo/train.py STORE --steps N --save-every K [--async-save] [--batch B] [--restore-only]
                         [--preemptible]

On start it restores the newest valid generation of STORE (if any) and continues
from there. It prints one JSON event per line: ``restored``, ``step``, ``saved``,
``done`` (with a digest of the final weights and the training loop's seconds).
``--save-every 0`` trains without checkpoints (the baseline for the overhead).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import time

# Bit-reproducible CPU kernels (see pin_threads): MKL's conditional numerical
# reproducibility mode must be chosen before MKL starts, so before torch is imported.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

import numpy as np
import torch
from blake3 import blake3

import ckptvault as cv
from ckptvault.ops.done import DONE_FILE_ENV, manifest_digest, write_done_record

CONFIG = {"width": 512, "depth": 3, "dropout": 0.1, "lr": 3e-4, "batch": 64, "seed": 1234}


def emit(event: str, **fields) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def build_state() -> dict:
    torch.manual_seed(CONFIG["seed"])
    np.random.seed(CONFIG["seed"])
    random.seed(CONFIG["seed"])
    layers: list[torch.nn.Module] = [torch.nn.Linear(32, CONFIG["width"])]
    for _ in range(CONFIG["depth"] - 1):
        layers += [
            torch.nn.GELU(),
            torch.nn.Dropout(CONFIG["dropout"]),
            torch.nn.Linear(CONFIG["width"], CONFIG["width"]),
        ]
    layers += [torch.nn.GELU(), torch.nn.Linear(CONFIG["width"], 1)]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=CONFIG["lr"])
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "sampler": np.random.default_rng(CONFIG["seed"]),  # picks the batches
        "rng": cv.RNGState(),
        "meta": {"next_step": 0, "samples_seen": 0},
    }


def weights_digest(model: torch.nn.Module) -> str:
    hasher = blake3()
    for tensor in model.state_dict().values():
        hasher.update(tensor.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


def write_done(mgr: cv.CheckpointManager, state: dict) -> None:
    """Under ``ckptvault supervise --done-file``: state what the job produced (its
    final generation and the samples it consumed), for the supervisor to check."""
    if not os.environ.get(DONE_FILE_ENV) or not mgr.generations():
        return
    final = mgr.generations()[0]
    write_done_record(
        run_id="demo",
        step=final.step,
        generation_id=final.generation_id,
        manifest_digest=manifest_digest(mgr.store, final.generation_id),
        config_digest=blake3(json.dumps(CONFIG, sort_keys=True).encode()).hexdigest(),
        tokens=state["meta"]["samples_seen"],
    )


def pin_threads() -> None:
    """Make the CPU kernels bit-reproducible from one process to the next.

    With more than one thread, MKL may split a matrix product differently in
    another process (measured here: about 1 run in 25 differs in the last bits of
    the very first loss), and without an explicit thread count MKL and OpenMP may
    even settle on a different number of threads. Exact resume needs the same
    kernels to give the same bits: a fixed thread count plus ``MKL_CBWR`` (set at
    the top of this file). ckptvault restores the state, not the math library's
    choices.
    """
    torch.set_num_threads(torch.get_num_threads())


def main() -> None:
    pin_threads()
    parser = argparse.ArgumentParser()
    parser.add_argument("store")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=25)
    parser.add_argument("--restore-only", action="store_true")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--batch", type=int, default=CONFIG["batch"])
    # SIGTERM (a scheduler's preemption) ends the job with a final save and exit 75.
    parser.add_argument("--preemptible", action="store_true")
    args = parser.parse_args()
    CONFIG["batch"] = args.batch

    state = build_state()
    features = torch.randn(4096, 32, generator=torch.Generator().manual_seed(0))
    targets = features[:, :4].sum(dim=1, keepdim=True).tanh()
    with cv.CheckpointManager(
        args.store,
        run_id="demo",
        contract={"config": CONFIG, "dataset": "synthetic-v1"},
        async_save=args.async_save,
        save_on_signal=(signal.SIGTERM,) if args.preemptible else None,
    ) as mgr:
        info = mgr.restore(state)
        emit(
            "restored",
            pid=os.getpid(),
            step=info.step if info else None,
            seconds=info.seconds if info else 0.0,
            skipped=[list(s) for s in info.skipped] if info else [],
        )
        if args.restore_only:
            return
        model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
        loop_started = time.perf_counter()
        stalls: list[float] = []
        while state["meta"]["next_step"] < args.steps:
            step = state["meta"]["next_step"]
            index = torch.from_numpy(state["sampler"].integers(0, len(features), CONFIG["batch"]))
            opt.zero_grad(set_to_none=True)
            loss = (model(features[index]) - targets[index]).square().mean()
            loss.backward()
            opt.step()
            sched.step()
            state["meta"]["next_step"] = step + 1
            state["meta"]["samples_seen"] += CONFIG["batch"]
            emit("step", step=step, loss=loss.item())
            if (args.save_every and (step + 1) % args.save_every == 0) or mgr.preempted:
                started = time.perf_counter()
                try:
                    handle = mgr.save(step, state)
                except cv.Preempted as preempted:  # the final save is published: exit 75
                    emit("preempted", step=preempted.step)
                    raise
                stalls.append(time.perf_counter() - started)
                if not args.async_save:
                    saved = handle.result()
                    emit("saved", step=step, seconds=stalls[-1], bytes=saved.bytes)
        waited = time.perf_counter()
        mgr.wait()  # the last background save is part of the loop's cost
        stalls.append(time.perf_counter() - waited)
        write_done(mgr, state)
        emit(
            "done",
            step=state["meta"]["next_step"] - 1,
            weights=weights_digest(state["model"]),
            loop_seconds=time.perf_counter() - loop_started,
            saves=mgr.stats.saves_completed,
            stall_seconds=sum(stalls),
        )


if __name__ == "__main__":
    main()
