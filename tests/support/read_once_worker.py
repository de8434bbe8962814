"""One rank of a 4-rank job that restores replicated state (``launch(worker=...)``).

``python read_once_worker.py SCENARIO STORE OUT`` with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT in the environment; writes what it saw to ``OUT/rank<r>.json``. The
state is what DDP and HSDP hold: plain tensors every rank holds whole (replicated),
and one weight on a 2x2 mesh, replicated over the first dimension and sharded over
the second (ranks 0 and 2 hold one half, 1 and 3 the other).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import ckptvault as cv
from support.dcp_worker import run_scenario

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
CHUNK = 256 * 1024  # small digest chunks: many blocks to share out in a small state
TENSORS, ELEMENTS = 6, 512 * 1024  # 6 replicated tensors of 2 MiB
ROWS, COLS = 256, 1024  # the HSDP weight: 1 MiB


def values(step: int, index: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + index)
    return torch.randn(ELEMENTS, generator=generator)


def hsdp_weight(step: int) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS) * step


def state_of(step: int, fill: bool = True) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (2, WORLD // 2))
    weight = hsdp_weight(step) if fill else torch.zeros(ROWS, COLS)
    return {
        "model": {
            **{f"w{i}": values(step, i) if fill else torch.zeros(ELEMENTS) for i in range(TENSORS)},
            "hsdp": distribute_tensor(weight, mesh, [Replicate(), Shard(0)]),
        },
        "meta": {"step": step if fill else 0},
    }


def exact(state: dict[str, Any], step: int) -> bool:
    model = state["model"]
    hsdp = model["hsdp"]
    assert isinstance(hsdp, DTensor)
    return all(torch.equal(model[f"w{i}"], values(step, i)) for i in range(TENSORS)) and bool(
        torch.equal(hsdp.full_tensor(), hsdp_weight(step))
    )


def rchar() -> int:
    """Bytes this process passed to read() and its kin (files; gloo's sockets use
    recv, which this does not count)."""
    with open("/proc/self/io") as stats:
        for line in stats:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def manager(store: str) -> cv.CheckpointManager:
    options: dict[str, Any] = {}
    if os.environ.get("TEST_KEYSTORE"):  # an encrypted run, when set
        options["keystore"] = os.environ["TEST_KEYSTORE"]
    return cv.CheckpointManager(
        store, run_id="ddp", chunk_size=CHUNK, collective_timeout_s=30, **options
    )


def save(store: str, out: dict[str, Any]) -> None:
    with manager(store) as mgr:
        for step in (1, 2):
            mgr.save(step, state_of(step))


def restore_once(store: str, out: dict[str, Any], key: str) -> None:
    """One restore into zeros: step, bit-exactness, bytes read, what it skipped."""
    live = state_of(0, fill=False)
    with manager(store) as mgr:
        before = rchar()
        try:
            info = mgr.restore(live)
        except cv.errors.CheckpointError as exc:
            out[key] = {
                "error": [type(exc).__name__, str(exc)],
                "untouched": bool(torch.count_nonzero(live["model"]["w0"]) == 0),
            }
            return
        read = rchar() - before
    assert info is not None
    out[key] = {
        "step": info.step,
        "exact": exact(live, info.step),
        "meta": live["meta"],
        "read": read,
        "bytes": info.bytes,
        "skipped": [[s.step, s.reason] for s in info.skipped],
    }


def restore(store: str, out: dict[str, Any]) -> None:
    """Every rank reading alone, then read-once (the default)."""
    os.environ["CKPTVAULT_READ_ONCE"] = "0"
    restore_once(store, out, "alone")
    del os.environ["CKPTVAULT_READ_ONCE"]
    restore_once(store, out, "once")


def restore_shared(store: str, out: dict[str, Any]) -> None:
    restore_once(store, out, "once")


def restore_dishonest(store: str, out: dict[str, Any]) -> None:
    """Rank 1 flips a byte of every block it sends after reading it: the others must
    refuse what it sent, never apply it."""
    from ckptvault.distributed.coordinator import TorchDistributed

    if RANK == 1:
        send = TorchDistributed.send_tensor

        def flipped(self: Any, tensor: torch.Tensor, destinations: list[int]) -> None:
            if tensor.numel() > 1:
                tensor = tensor.clone()
                tensor[0] ^= 1
            send(self, tensor, destinations)

        TorchDistributed.send_tensor = flipped  # type: ignore[method-assign]
    restore_once(store, out, "once")


SCENARIOS = {
    "save": save,
    "restore": restore,
    "restore_shared": restore_shared,
    "restore_dishonest": restore_dishonest,
}


if __name__ == "__main__":
    run_scenario(SCENARIOS)
