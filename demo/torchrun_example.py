"""ckptvault under torchrun: a sharded model saved by every rank, restored after a restart.

    torchrun --nproc_per_node 2 demo/torchrun_example.py /tmp/ckpt-torchrun

Run it twice: the second run resumes from the step the first one saved (on any
number of ranks: the weight is resharded on restore).
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import ckptvault as cv


def main(store: str) -> None:
    dist.init_process_group("gloo")  # "nccl" on GPUs, after torch.cuda.set_device(local_rank)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    weight = distribute_tensor(torch.zeros(16, 8), mesh, [Shard(0)])  # each rank: its rows
    state = {
        "model": {"weight": weight},
        "rng": cv.RNGState(),  # per rank: each rank gets its own RNG back
        "progress": {"step": 0},  # global: saved once, restored on every rank
    }
    with cv.CheckpointManager(store, run_id="torchrun-example") as manager:
        info = manager.restore(state)  # collective: every rank takes the same generation
        start = state["progress"]["step"]
        for step in range(start + 1, start + 4):
            with torch.no_grad():
                weight.add_(1.0)
            state["progress"]["step"] = step
            manager.save(step, state)  # collective: one generation for all ranks
    if dist.get_rank() == 0:
        resumed = f"resumed at step {info.step}" if info else "started fresh"
        print(f"{resumed}; saved steps {start + 1}..{start + 3} from {dist.get_world_size()} ranks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
