"""Save and restore speed: ckptvault against the raw disk limit and its peers, in one run.

    python -m bench.save_restore --size-gb 1 [--reps 3] [--dir bench-out/work]

Builds a model + AdamW state of about ``--size-gb`` GB and, interleaved over
``--reps`` repetitions, measures (medians printed, ratios against the raw limit):

- durable saves: raw write+fsync of the same bytes (as many files and threads as
  ckptvault uses, write-behind, one fsync per file: the disk's limit; also the naive
  one-file write-then-fsync), torch.save+fsync, safetensors
  save_file+fsync, DCP save(sync_files=True), ckptvault save, ckptvault encrypted save;
- the async stall: ckptvault's first and steady-state async save against a plain clone
  of the state and a copy into preallocated buffers;
- cold-cache restore into freshly built objects: ckptvault (verified),
  torch.load(weights_only=True) + load_state_dict, DCP load;
- the peak extra resident memory of each.

Pages are dropped before each restore (``/proc/sys/vm/drop_caches`` as root,
``posix_fadvise(DONTNEED)`` otherwise). Results go to ``bench-out/results.json`` and a
Markdown table is printed for the README.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import os
import platform
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import ckptvault as cv
from ckptvault.io.writer import default_threads

PAGE = os.sysconf("SC_PAGE_SIZE")


# -- measuring ---------------------------------------------------------------------------


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


class PeakRSS:
    """Samples resident memory on a thread; ``extra`` is the peak above the start."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.extra = 0

    def __enter__(self) -> PeakRSS:
        self._start = rss_bytes()
        self._peak = self._start
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, rss_bytes())
            time.sleep(self.interval)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, rss_bytes())
        self.extra = self._peak - self._start


def fsync_path(path: Path) -> None:
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_caches(path: Path) -> str:
    """Evict ``path``'s pages so the next read comes from the disk."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
        return "drop_caches"
    except OSError:
        pass
    for file in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


# -- the state ---------------------------------------------------------------------------


def build(size_gb: float, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model + AdamW whose state totals about ``size_gb`` GB (fp32 weights, 2 moments)."""
    torch.manual_seed(seed)
    params = int(size_gb * 1e9 / 12)
    width = 4096
    layers = max(1, params // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return model, opt


def fresh_like(size_gb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, _ = build(size_gb, seed=1)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def tensors_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, entry in opt.state_dict()["state"].items():
        for name, value in entry.items():
            if value.dim():
                flat[f"opt.{pid}.{name}"] = value
    return flat


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(model, opt).values())


# -- the contenders ----------------------------------------------------------------------


def raw_write_behind(path: Path, tensors: dict[str, torch.Tensor], files: int) -> None:
    """The disk's limit for a durable write: the same bytes split over ``files`` files
    written in parallel (as ckptvault does), 8 MiB writes handed to writeback at once
    (sync_file_range), one fsync per file. No hashing, no format, no manifest."""
    from concurrent.futures import ThreadPoolExecutor

    from ckptvault.storage.posix_files import PosixWritableFile

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


# -- the run -----------------------------------------------------------------------------


@contextlib.contextmanager
def scratch(root: Path, name: str) -> Iterator[Path]:
    path = root / name
    shutil.rmtree(path, ignore_errors=True)
    if path.exists():
        path.unlink()
    try:
        yield path
    finally:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.exists():
            path.unlink()


def quiesce() -> None:
    """Start every measurement from a quiet disk: no dirty pages left by the last one."""
    os.sync()
    time.sleep(0.3)


def timed(fn: Callable[[], object]) -> tuple[float, int]:
    gc.collect()
    quiesce()
    with PeakRSS() as peak:
        started = time.perf_counter()
        fn()
        seconds = time.perf_counter() - started
    return seconds, peak.extra


def run_saves(
    root: Path,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    keys: Path,
) -> Iterator[tuple[str, tuple[float, int]]]:
    """Durable saves of the same state by every contender, in a rotating order."""
    state = {"model": model, "optimizer": opt}

    def raw() -> tuple[float, int]:
        with scratch(root, "raw.bin") as path:
            return timed(lambda: raw_write_behind(path, tensors, default_threads()))

    def raw_naive() -> tuple[float, int]:
        with scratch(root, "raw-naive.bin") as path:
            return timed(lambda: raw_write(path, tensors))

    def torch_pt() -> tuple[float, int]:
        with scratch(root, "torch.pt") as path:
            return timed(lambda: torch_save(path, model, opt))

    def safetensors_file() -> tuple[float, int]:
        with scratch(root, "st.safetensors") as path:
            return timed(lambda: safetensors_save(path, tensors))

    def dcp_dir() -> tuple[float, int]:
        with scratch(root, "dcp") as path:
            return timed(lambda: dcp_save(path, model, opt))

    def vault() -> tuple[float, int]:
        with scratch(root, "vault") as path, cv.CheckpointManager(path, run_id="bench") as mgr:
            return timed(lambda: mgr.save(1, state))

    def vault_encrypted() -> tuple[float, int]:
        shutil.rmtree(keys, ignore_errors=True)
        with (
            scratch(root, "vault-enc") as path,
            cv.CheckpointManager(path, run_id="bench", keystore=keys) as mgr,
        ):
            mgr.save(0, {"warm": torch.ones(1)})  # the run's key is created once, not per save
            return timed(lambda: mgr.save(1, state))

    contenders = [
        ("raw write+fsync", raw),
        ("raw write, one file, then one fsync", raw_naive),
        ("torch.save+fsync", torch_pt),
        ("safetensors save_file+fsync", safetensors_file),
        ("DCP save(sync_files=True)", dcp_dir),
        ("ckptvault save", vault),
        ("ckptvault encrypted save", vault_encrypted),
    ]
    shift = next(_rotation) % len(contenders)
    for name, measure in contenders[shift:] + contenders[:shift]:
        yield name, measure()


_rotation = itertools.count()


def run_async(
    root: Path, state: dict, tensors: dict[str, torch.Tensor]
) -> Iterator[tuple[str, tuple[float, int]]]:
    """The stall of an asynchronous save against a clone and a copy of the state."""
    yield "plain clone of the state", timed(lambda: {k: v.clone() for k, v in tensors.items()})
    buffers = {k: torch.zeros_like(v) for k, v in tensors.items()}  # allocated and touched
    yield (
        "copy into preallocated buffers",
        timed(lambda: [buffers[k].copy_(v) for k, v in tensors.items()]),
    )
    buffers.clear()
    with (
        scratch(root, "vault-async") as path,
        cv.CheckpointManager(path, run_id="bench", async_save=True) as mgr,
    ):
        yield "ckptvault async stall, first save", timed(lambda: mgr.save(1, state))
        mgr.wait()
        yield "ckptvault async stall, steady state", timed(lambda: mgr.save(2, state))
        mgr.wait()


def run_restores(
    root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, size_gb: float
) -> Iterator[tuple[str, tuple[float, int]]]:
    """Cold-cache restores into freshly built objects."""
    state = {"model": model, "optimizer": opt}
    with scratch(root, "vault-restore") as path:
        with cv.CheckpointManager(path, run_id="bench") as mgr:
            mgr.save(1, state)
        target_model, target_opt = fresh_like(size_gb)
        drop_caches(path)

        def vault_restore() -> None:
            with cv.CheckpointManager(path, run_id="bench") as reader:
                reader.restore({"model": target_model, "optimizer": target_opt})

        yield "ckptvault restore (verified)", timed(vault_restore)
        assert torch.equal(next(target_model.parameters()), next(model.parameters()))
    with scratch(root, "torch-restore.pt") as path:
        torch_save(path, model, opt)
        target_model, target_opt = fresh_like(size_gb)
        drop_caches(path)

        def torch_restore() -> None:
            loaded = torch.load(path, weights_only=True)
            target_model.load_state_dict(loaded["model"])
            target_opt.load_state_dict(loaded["optimizer"])

        yield "torch.load(weights_only)+load_state_dict", timed(torch_restore)
    with scratch(root, "dcp-restore") as path:
        dcp_save(path, model, opt)
        target_model, target_opt = fresh_like(size_gb)
        drop_caches(path)

        def dcp_restore() -> None:
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model_sd, opt_sd = get_state_dict(target_model, target_opt)
            sd = {"model": model_sd, "optimizer": opt_sd}
            dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
            set_state_dict(
                target_model,
                target_opt,
                model_state_dict=sd["model"],
                optim_state_dict=sd["optimizer"],
            )

        yield "DCP load", timed(dcp_restore)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("bench-out/work"))
    parser.add_argument("--out", type=Path, default=Path("bench-out/results.json"))
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    model, opt = build(args.size_gb)
    tensors = tensors_of(model, opt)
    nbytes = state_bytes(model, opt)
    keys = Path(tempfile.mkdtemp(prefix="ckptvault-bench-keys-"))
    state = {"model": model, "optimizer": opt}
    print(
        f"state: {nbytes / 1e9:.2f} GB in {len(tensors)} tensors; {args.reps} repetitions in {args.dir}"
    )

    results: dict[str, list[tuple[float, int]]] = {}

    def record(name: str, measurement: tuple[float, int]) -> None:
        results.setdefault(name, []).append(measurement)

    for rep in range(args.reps):
        print(f"repetition {rep + 1}/{args.reps}", flush=True)
        for name, measurement in run_saves(args.dir, model, opt, tensors, keys):
            record(name, measurement)
        for name, measurement in run_async(args.dir, state, tensors):
            record(name, measurement)
        for name, measurement in run_restores(args.dir, model, opt, args.size_gb):
            record(name, measurement)

    report(results, nbytes, args)
    shutil.rmtree(keys, ignore_errors=True)


def report(
    results: dict[str, list[tuple[float, int]]], nbytes: int, args: argparse.Namespace
) -> None:
    medians = {
        name: (statistics.median(s for s, _ in runs), max(m for _, m in runs))
        for name, runs in results.items()
    }
    raw = medians["raw write+fsync"][0]
    clone = medians["plain clone of the state"][0]
    copy = medians["copy into preallocated buffers"][0]
    torch_restore = medians["torch.load(weights_only)+load_state_dict"][0]
    rows = []
    for name, (seconds, peak) in medians.items():
        if "restore" in name or "load" in name:
            ratio = f"{torch_restore / seconds:.2f} x torch.load speed"
        elif "stall" in name or name in (
            "plain clone of the state",
            "copy into preallocated buffers",
        ):
            ratio = f"{seconds / clone:.2f} x clone, {seconds / copy:.2f} x copy"
        else:
            ratio = f"{raw / seconds:.2f} x raw speed"
        best = min(s for s, _ in results[name])
        rows.append((name, seconds, best, nbytes / seconds / 1e9, ratio, peak / 1e6))
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, Python {platform.python_version()}"
    lines = [
        f"State: {nbytes / 1e9:.2f} GB (model + AdamW), medians of {args.reps} interleaved runs; {machine}.",
        "",
        "| operation | median s | best s | GB/s (median) | ratio (medians) | peak extra RSS (MB) |",
        "|---|---:|---:|---:|---|---:|",
    ]
    lines += [f"| {n} | {s:.3f} | {b:.3f} | {g:.2f} | {r} | {m:.0f} |" for n, s, b, g, r, m in rows]
    table = "\n".join(lines)
    print()
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "bytes": nbytes,
                "machine": machine,
                "reps": args.reps,
                "results": {
                    n: {"seconds": runs, "median": medians[n][0]} for n, runs in results.items()
                },
                "table": table,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
