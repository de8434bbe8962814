"""The state every benchmark saves, and the peers ckptvault is measured against:
the disk's raw limit, torch.save/load, safetensors and DCP, each durable (fsync)
and each restoring into live objects, as a training job would."""

from __future__ import annotations

import os
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

from bench.measure import fsync_path

# -- the state ---------------------------------------------------------------------------


def build(
    size_gb: float, seed: int = 0, width: int = 4096
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model + AdamW whose state totals about ``size_gb`` GB (fp32 weights, 2 moments),
    in layers of ``width`` x ``width`` (at least one)."""
    torch.manual_seed(seed)
    params = int(size_gb * 1e9 / 12)
    layers = max(1, params // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def fresh_like(size_gb: float, width: int = 4096) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Objects of the same layout as :func:`build`'s, to restore into (no moments yet,
    as in a freshly started job)."""
    model, _ = build(size_gb, seed=1, width=width)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def tensors_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the state under a flat name (``model.<key>``, ``opt.<id>.<key>``)."""
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, entry in opt.state_dict()["state"].items():
        for name, value in entry.items():
            flat[f"opt.{pid}.{name}"] = value
    return flat


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(model, opt).values())


# -- durable saves -----------------------------------------------------------------------


def raw_write_behind(path: Path, tensors: dict[str, torch.Tensor], files: int) -> None:
    """The disk's limit for a durable write: the same bytes split over ``files`` files
    written in parallel (as ckptvault does), 8 MiB writes handed to writeback at once
    (sync_file_range), one fsync per file. No hashing, no format, no manifest."""
    from ckptvault.storage.posix.files import PosixWritableFile

    path.mkdir()
    groups: list[list[torch.Tensor]] = [[] for _ in range(files)]
    loads = [0] * files
    for tensor in sorted(tensors.values(), key=lambda t: -t.numel() * t.element_size()):
        target = loads.index(min(loads))
        groups[target].append(tensor)
        loads[target] += tensor.numel() * tensor.element_size()

    def write(index: int) -> None:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            sink = PosixWritableFile(dir_fd, f"{index}.bin", str(path / f"{index}.bin"))
        finally:
            os.close(dir_fd)
        for tensor in groups[index]:
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            for start in range(0, len(view), 8 << 20):
                sink.write(view[start : start + (8 << 20)])
        sink.commit()

    with ThreadPoolExecutor(files) as pool:
        list(pool.map(write, range(files)))


def raw_write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The naive limit: one file, written front to back, then one fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for tensor in tensors.values():
            view = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            written = 0
            while written < len(view):
                written += os.write(fd, view[written:])
        os.fsync(fd)
    finally:
        os.close(fd)


def torch_save(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    with open(path, "wb") as handle:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, handle)
        handle.flush()
        os.fsync(handle.fileno())


def safetensors_save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path))
    fsync_path(path)


def dcp_save(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, opt_sd = get_state_dict(model, opt)  # DCP's own (FQN-keyed) state dicts
    writer = dcp.FileSystemWriter(str(path), sync_files=True)
    dcp.save({"model": model_sd, "optimizer": opt_sd}, storage_writer=writer, no_dist=True)


# -- restores into live objects ----------------------------------------------------------


def torch_restore(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loaded = torch.load(path, weights_only=True)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])


def safetensors_restore(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """``load_file`` of :func:`tensors_of`'s flat names, then both ``load_state_dict``."""
    flat = load_file(str(path))
    model.load_state_dict({k.removeprefix("model."): v for k, v in flat.items() if k[0] == "m"})
    per_param: dict[int, dict[str, Any]] = defaultdict(dict)
    for key, value in flat.items():
        if key.startswith("opt."):
            _, pid, name = key.split(".", 2)
            per_param[int(pid)][name] = value
    groups = opt.state_dict()["param_groups"]
    opt.load_state_dict({"state": dict(per_param), "param_groups": groups})


def dcp_restore(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, opt_sd = get_state_dict(model, opt)
    sd = {"model": model_sd, "optimizer": opt_sd}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
