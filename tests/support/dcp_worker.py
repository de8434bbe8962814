"""One rank of a multi-rank job using ckptvault's DCP plugin with plain DCP calls.

``python dcp_worker.py SCENARIO STORE OUT`` with RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT in the environment (``launch`` below starts the ranks); writes what it
saw to ``OUT/rank<r>.json``. The code in the scenarios is written as DCP users
write it (torchtitan style): ``get_state_dict`` of a ``fully_shard``-ed model and
its optimizer (``param_groups`` included), ``dcp.save``/``dcp.async_save``/
``dcp.load``, ``set_state_dict``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import ckptvault as cv

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RUN = "dcp-job"
KEYS = os.environ.get("TEST_KEYS", "")  # "private.pem:public.pem", or empty: unsigned

warnings.filterwarnings("ignore")


# -- launching ---------------------------------------------------------------------------


def launch(
    scenario: str, store: str | Path, world: int, out: Path, env: dict[str, str] | None = None
) -> tuple[list[int], list[dict[str, Any]]]:
    """Run ``world`` ranks of ``scenario`` (gloo on 127.0.0.1); their exit codes and
    reports (a rank that died leaves only its log)."""
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in range(world):
        rank_env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            **(env or {}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, scenario, str(store), str(out)],
                env=rank_env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    logs = []
    try:
        logs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    reports = []
    for rank in range(world):
        path = out / f"rank{rank}.json"
        report = json.loads(path.read_text()) if path.exists() else {}
        report["log"] = logs[rank][-3000:]
        reports.append(report)
    return [proc.returncode for proc in procs], reports


# -- helpers -----------------------------------------------------------------------------


def signing() -> dict[str, Any]:
    return {"signing_key": KEYS.split(":")[0]} if KEYS else {}


def trusting() -> dict[str, Any]:
    return {"trusted_keys": KEYS.split(":")[1]} if KEYS else {}


def flat(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, dict):
        out: dict[str, torch.Tensor] = {}
        for key in sorted(tree, key=str):
            out.update(flat(tree[key], f"{prefix}{key}/"))
        return out
    return {prefix.rstrip("/"): tree}


def digests(tree: Any) -> dict[str, str]:
    """SHA-256 of every full tensor (a DTensor gathered: collective, same order on
    every rank), with dtype and shape: equal digests mean bit-identical tensors."""
    result = {}
    for key, tensor in flat(tree).items():
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        full = full.detach().contiguous().cpu()
        data = full.reshape(-1).view(torch.uint8).numpy().tobytes()
        result[key] = f"{full.dtype}{list(full.shape)}:{hashlib.sha256(data).hexdigest()}"
    return result


def sharded_model(seed: int, lr: float = 0.05) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small MLP with FSDP2 over every rank (10 rows: uneven shards on 3 ranks)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 4))
    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    torch.manual_seed(seed)  # the same batch on every rank
    model(torch.randn(8, 6)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def canonical_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """DCP's canonical state dict: the model's tensors, the optimizer's per-parameter
    state and its param_groups (plain hyperparameters, stored as JSON)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def tensor_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The tensors of :func:`canonical_state` (what :func:`digests` compares)."""
    state = canonical_state(model, optimizer)
    return {"model": state["model"], "optim": {"state": state["optim"]["state"]}}


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


# -- scenarios ---------------------------------------------------------------------------


def fsdp_save(store: str, out: dict[str, Any]) -> None:
    model, optimizer = sharded_model(seed=0)
    train_step(model, optimizer, seed=1)
    state = canonical_state(model, optimizer)
    writer = cv.dcp.StorageWriter(store, run_id=RUN, step=1, **signing())
    dcp.save(state, storage_writer=writer)
    out["published"] = writer.published.generation_id if writer.published else None
    out["digests"] = digests(tensor_state(model, optimizer))
    out["groups"] = hyperparameters(optimizer)
    # A value JSON cannot hold: ckptvault's own error on every rank, out of plain
    # dcp.save (no context around it), and nothing published.
    try:
        bad = {**state, "hooks": {"a", "b"}}
        dcp.save(bad, storage_writer=cv.dcp.StorageWriter(store, run_id=RUN, step=2))
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        out["refused"] = [f"{type(exc).__module__}.{type(exc).__name__}", str(exc)]
    gc.collect()  # the failed writer's finalizer removes what its attempt left
    dist.barrier()


def fsdp_load(store: str, out: dict[str, Any]) -> None:
    # Other weights and another learning rate: all must be replaced.
    model, optimizer = sharded_model(seed=7, lr=0.5)
    state = canonical_state(model, optimizer)  # initializes the Adam state
    reader = cv.dcp.StorageReader(store, run_id=RUN, **trusting())
    dcp.load(state, storage_reader=reader)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    out.update(step=reader.step, generation=reader.generation_id, signer=reader.signer)
    out["digests"] = digests(tensor_state(model, optimizer))
    out["groups"] = hyperparameters(optimizer)
    weight = model[0].weight
    out["local_rows"] = int(weight.to_local().shape[0]) if isinstance(weight, DTensor) else 10
    train_step(model, optimizer, seed=2)  # training goes on from the restored state
    out["stepped"] = True


def plain_state(step: int) -> dict[str, Any]:
    full = torch.arange(60, dtype=torch.float32).reshape(10, 6) * step
    mesh = init_device_mesh("cpu", (WORLD,))
    return {
        "w": distribute_tensor(full, mesh, [Shard(0)]),
        "extra": {"bias": torch.full((3,), float(step)), "ids": torch.arange(5) + step},
    }


def async_roundtrip(store: str, out: dict[str, Any]) -> None:
    """dcp.async_save twice (each awaited), then dcp.load of the newest."""
    for step in (3, 4):
        writer = cv.dcp.StorageWriter(store, run_id=RUN, step=step)
        future = dcp.async_save(plain_state(step), storage_writer=writer)
        future.result()
    live = plain_state(0)
    reader = cv.dcp.StorageReader(store, run_id=RUN)
    dcp.load(live, storage_reader=reader)
    out["step"] = reader.step
    out["exact"] = digests(live) == digests(plain_state(4))


def fail_in_write(store: str, out: dict[str, Any]) -> None:
    """Rank 1's disk fails while it writes: nothing is published, every rank raises
    the same typed error, the attempt is removed, and the next save works."""
    from ckptvault.io import writer as io_writer

    original = io_writer.VaultStorageWriter._write_file

    def broken(self: Any, name: str, items: Any, planner: Any) -> Any:
        if RANK == 1:
            raise OSError(5, "Input/output error (injected on rank 1)")
        return original(self, name, items, planner)

    io_writer.VaultStorageWriter._write_file = broken  # type: ignore[method-assign]
    try:
        with cv.dcp.typed_errors():
            dcp.save(plain_state(5), storage_writer=cv.dcp.StorageWriter(store, run_id=RUN, step=5))
    except OSError as exc:
        out["error"] = [type(exc).__name__, str(exc)]
    finally:
        io_writer.VaultStorageWriter._write_file = original  # type: ignore[method-assign]
    gc.collect()  # the failed writer is garbage: its finalizer removed its attempt
    dist.barrier()
    if RANK == 0:
        out["staging_after_failure"] = sorted(os.listdir(Path(store, ".staging")))
    writer = cv.dcp.StorageWriter(store, run_id=RUN, step=6)
    dcp.save(plain_state(6), storage_writer=writer)
    out["published"] = writer.published.step if writer.published else None


SCENARIOS = {
    "fsdp_save": fsdp_save,
    "fsdp_load": fsdp_load,
    "async_roundtrip": async_roundtrip,
    "fail_in_write": fail_in_write,
}


def run_scenario(scenarios: dict[str, Any]) -> str:
    """``python WORKER SCENARIO STORE OUT`` on one rank: join the gloo job, run the
    scenario, write what it saw to ``OUT/rank<r>.json`` (even when it raised); the
    scenario's name. Shared by the rank workers that :func:`launch` starts."""
    scenario, store, out_dir = sys.argv[1:4]
    dist.init_process_group("gloo")
    out: dict[str, Any] = {"rank": RANK, "world": WORLD}
    try:
        scenarios[scenario](store, out)
    finally:
        Path(out_dir, f"rank{RANK}.json").write_text(json.dumps(out))
        dist.destroy_process_group()
    return scenario


def main() -> None:
    if run_scenario(SCENARIOS) == "async_roundtrip":
        # torch 2.13 aborts about one exit in twenty after dcp.async_save ("terminate
        # called without an active exception" in its C++ teardown), with its own
        # FileSystemWriter as well as ckptvault's: measured 1 in 23 and 1 in 12 runs.
        # The report is written; skip the interpreter's teardown.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
