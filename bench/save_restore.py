"""Save and restore speed: ckptvault against the raw disk limit and its peers, in one run.

    python -m bench.save_restore --size-gb 1 [--reps 7] [--dir bench-out/work]

Builds a model + AdamW state of about ``--size-gb`` GB and, interleaved over
``--reps`` repetitions with the order of the contenders rotated, measures:

- durable saves to the disk: raw write+fsync of the same bytes (as many files and
  threads as ckptvault uses, write-behind, one fsync per file: the disk's limit; also
  the naive one-file write-then-fsync), torch.save+fsync, safetensors
  save_file+fsync, DCP save(sync_files=True), ckptvault save, ckptvault encrypted save;
- the same on tmpfs (``--tmpfs-dir``), where no disk hides the software pipeline;
- the async stall: ckptvault's first save (with and without ``prepare``) and its
  steady state against a plain clone of the state and a copy into preallocated buffers;
- cold-cache restores into freshly built objects: ckptvault (verified),
  torch.load(weights_only=True) + load_state_dict, safetensors load_file +
  load_state_dict, DCP load;
- the peak extra resident memory of each.

Pages are dropped before each restore (``/proc/sys/vm/drop_caches`` as root,
``posix_fadvise(DONTNEED)`` otherwise). Prints a Markdown table for the README and
whether each target is met, judged on best runs (this VM's noise moves the minimum
least); results go to ``bench-out/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import ckptvault as cv
from bench.contenders import (
    build,
    dcp_restore,
    dcp_save,
    fresh_like,
    raw_write,
    raw_write_behind,
    safetensors_restore,
    safetensors_save,
    state_bytes,
    tensors_of,
    torch_restore,
    torch_save,
)
from bench.measure import drop_caches, rotated, scratch, timed
from ckptvault.io.writer import default_threads

Measurement = tuple[float, int]  # seconds, peak extra resident bytes
TMPFS = "tmpfs: "
# name, the row it is measured against, the bound, "min" (at least) or "max" (at most)
TARGETS = [
    ("ckptvault save", "raw write+fsync", 0.9, "min", "durable save vs the raw disk"),
    (TMPFS + "ckptvault save", TMPFS + "safetensors save_file+fsync", 0.8, "min",
     "tmpfs save vs safetensors"),
    ("ckptvault restore (verified)", "torch.load(weights_only)+load_state_dict", 1.2, "min",
     "verified restore vs torch.load + load_state_dict"),
    ("ckptvault async stall, first save after prepare()", "plain clone of the state", 0.5,
     "max", "first async stall vs a clone"),
]  # fmt: skip


def run_saves(
    root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, keys: Path, prefix: str = ""
) -> Iterator[tuple[str, Measurement]]:
    """Durable saves of the same state by every contender, in a rotating order. With
    a ``prefix`` (tmpfs) only the contenders that show the software pipeline."""
    state = {"model": model, "optimizer": opt}
    tensors = tensors_of(model, opt)

    def at(name: str, save: Callable[[Path], object]) -> Callable[[], Measurement]:
        def measure() -> Measurement:
            with scratch(root, name) as path:
                return timed(lambda: save(path))

        return measure

    def vault(path: Path) -> Callable[[], Measurement]:
        def measure() -> Measurement:
            with cv.CheckpointManager(path, run_id="bench") as mgr:
                return timed(lambda: mgr.save(1, state))

        return measure

    def vault_encrypted() -> Measurement:
        shutil.rmtree(keys, ignore_errors=True)
        with (
            scratch(root, "vault-enc") as path,
            cv.CheckpointManager(path, run_id="bench", keystore=keys) as mgr,
        ):
            mgr.save(0, {"warm": torch.ones(1)})  # the run's key is created once, not per save
            return timed(lambda: mgr.save(1, state))

    def vault_plain() -> Measurement:
        with scratch(root, "vault") as path:
            return vault(path)()

    contenders: list[tuple[str, Callable[[], Measurement]]] = [
        ("raw write+fsync", at("raw", lambda p: raw_write_behind(p, tensors, default_threads()))),
        ("torch.save+fsync", at("torch.pt", lambda p: torch_save(p, model, opt))),
        ("safetensors save_file+fsync", at("st.safetensors", lambda p: safetensors_save(p, tensors))),
        ("ckptvault save", vault_plain),
    ]  # fmt: skip
    if not prefix:
        contenders += [
            ("raw write, one file, then one fsync", at("raw-naive", lambda p: raw_write(p, tensors))),
            ("DCP save(sync_files=True)", at("dcp", lambda p: dcp_save(p, model, opt))),
            ("ckptvault encrypted save", vault_encrypted),
        ]  # fmt: skip
    for name, measure in rotated(contenders):
        yield prefix + name, measure()


def run_async(root: Path, state: dict[str, Any]) -> Iterator[tuple[str, Measurement]]:
    """The stall of an asynchronous save against a clone and a copy of the state."""
    tensors = tensors_of(state["model"], state["optimizer"])

    def clone() -> Iterator[tuple[str, Measurement]]:
        yield "plain clone of the state", timed(lambda: {k: v.clone() for k, v in tensors.items()})

    def copy() -> Iterator[tuple[str, Measurement]]:
        buffers = {k: torch.zeros_like(v) for k, v in tensors.items()}  # allocated and touched
        yield (
            "copy into preallocated buffers",
            timed(lambda: [buffers[k].copy_(v) for k, v in tensors.items()]),
        )

    def vault(prepared: bool) -> Iterator[tuple[str, Measurement]]:
        name = "vault-async-prepared" if prepared else "vault-async"
        with (
            scratch(root, name) as path,
            cv.CheckpointManager(path, run_id="bench", async_save=True) as mgr,
        ):
            if prepared:  # as a job would, once its optimizer has stepped
                mgr.prepare(state, wait=True)
                yield (
                    "ckptvault async stall, first save after prepare()",
                    timed(lambda: mgr.save(1, state)),
                )
            else:
                yield "ckptvault async stall, first save", timed(lambda: mgr.save(1, state))
            mgr.wait()
            if not prepared:
                yield "ckptvault async stall, steady state", timed(lambda: mgr.save(2, state))
                mgr.wait()

    blocks = [clone, copy, lambda: vault(False), lambda: vault(True)]
    for block in rotated(blocks):
        yield from block()


def run_restores(
    root: Path,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    size_gb: float,
    prefix: str = "",
) -> Iterator[tuple[str, Measurement]]:
    """Cold-cache restores into freshly built objects, in a rotating order. On tmpfs
    (a ``prefix``) nothing is cold: the figures show the software pipeline alone."""
    state = {"model": model, "optimizer": opt}

    def cold(name: str, save: Callable[[Path], object], restore: Callable[..., object]):
        def measure() -> Measurement:
            with scratch(root, name) as path:
                save(path)
                target_model, target_opt = fresh_like(size_gb)
                drop_caches(path)
                result = timed(lambda: restore(path, target_model, target_opt))
                assert torch.equal(next(target_model.parameters()), next(model.parameters()))
                return result

        return measure

    def vault_save(path: Path) -> None:
        with cv.CheckpointManager(path, run_id="bench") as mgr:
            mgr.save(1, state)

    def vault_restore(path: Path, target_model: Any, target_opt: Any) -> None:
        with cv.CheckpointManager(path, run_id="bench") as reader:
            reader.restore({"model": target_model, "optimizer": target_opt})

    tensors = tensors_of(model, opt)
    contenders = [
        ("ckptvault restore (verified)", cold("vault-restore", vault_save, vault_restore)),
        ("torch.load(weights_only)+load_state_dict",
         cold("torch-restore.pt", lambda p: torch_save(p, model, opt), torch_restore)),
        ("safetensors load_file+load_state_dict",
         cold("st-restore.safetensors", lambda p: safetensors_save(p, tensors), safetensors_restore)),
        ("DCP load", cold("dcp-restore", lambda p: dcp_save(p, model, opt), dcp_restore)),
    ]  # fmt: skip
    for name, measure in rotated(contenders):
        yield prefix + name, measure()


def tmpfs_root(requested: Path | None, nbytes: int) -> Path | None:
    """Where the tmpfs figures are measured: ``requested``, else a directory under
    ``/dev/shm`` when it has room for a few copies of the state; None to skip them."""
    if requested is None:
        shm = Path("/dev/shm")
        if not shm.is_dir() or not os.access(shm, os.W_OK):
            return None
        stats = os.statvfs(shm)
        if stats.f_bavail * stats.f_frsize < 3 * nbytes:
            return None
        requested = shm / f"ckptvault-bench-{os.getpid()}"
    requested.mkdir(parents=True, exist_ok=True)
    return requested


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path("bench-out/work"))
    parser.add_argument("--tmpfs-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path("bench-out/results.json"))
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    model, opt = build(args.size_gb)
    nbytes = state_bytes(model, opt)
    keys = Path(tempfile.mkdtemp(prefix="ckptvault-bench-keys-"))
    tmpfs = tmpfs_root(args.tmpfs_dir, nbytes)
    state = {"model": model, "optimizer": opt}
    count = len(tensors_of(model, opt))
    print(f"state: {nbytes / 1e9:.2f} GB in {count} tensors; {args.reps} repetitions in {args.dir}")
    results: dict[str, list[Measurement]] = {}
    try:
        for rep in range(args.reps):
            print(f"repetition {rep + 1}/{args.reps}", flush=True)
            phases = [
                lambda: run_saves(args.dir, model, opt, keys),
                lambda: run_async(args.dir, state),
                lambda: run_restores(args.dir, model, opt, args.size_gb),
            ]
            if tmpfs is not None:
                phases.append(lambda: run_saves(tmpfs, model, opt, keys, TMPFS))
                phases.append(lambda: run_restores(tmpfs, model, opt, args.size_gb, TMPFS))
            for phase in rotated(phases):
                for name, measurement in phase():
                    results.setdefault(name, []).append(measurement)
    finally:
        shutil.rmtree(keys, ignore_errors=True)
        if tmpfs is not None and args.tmpfs_dir is None:
            shutil.rmtree(tmpfs, ignore_errors=True)
    report(results, nbytes, args)


def _baseline(name: str) -> tuple[str, str]:
    """The row ``name`` is compared with, and how the ratio reads."""
    if "restore" in name or "load" in name:
        prefix = TMPFS if name.startswith(TMPFS) else ""
        return prefix + "torch.load(weights_only)+load_state_dict", "x torch.load speed"
    if name.startswith(TMPFS):
        return TMPFS + "safetensors save_file+fsync", "x safetensors speed"
    if "stall" in name or name in ("plain clone of the state", "copy into preallocated buffers"):
        return "plain clone of the state", "x clone time"
    return "raw write+fsync", "x raw speed"


def report(results: dict[str, list[Measurement]], nbytes: int, args: argparse.Namespace) -> None:
    median = {n: statistics.median(s for s, _ in runs) for n, runs in results.items()}
    best = {n: min(s for s, _ in runs) for n, runs in results.items()}
    peak = {n: max(m for _, m in runs) for n, runs in results.items()}
    rows = []
    for name in results:
        base, unit = _baseline(name)
        if unit == "x clone time":
            ratios = (median[name] / median[base], best[name] / best[base])
        else:
            ratios = (median[base] / median[name], best[base] / best[name])
        rows.append(
            f"| {name} | {median[name]:.3f} | {best[name]:.3f} | {nbytes / median[name] / 1e9:.2f} "
            f"| {ratios[0]:.2f} {unit} | {ratios[1]:.2f} | {peak[name] / 1e6:.0f} |"
        )
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"Python {platform.python_version()}"
    )
    lines = [
        f"State: {nbytes / 1e9:.2f} GB (model + AdamW), {args.reps} interleaved runs; {machine}.",
        "",
        "| operation | median s | best s | GB/s (median) | ratio (medians) | ratio (best runs) "
        "| peak extra RSS (MB) |",
        "|---|---:|---:|---:|---|---:|---:|",
        *rows,
        "",
        "Targets, judged on best runs:",
        "",
        *verdicts(best),
    ]
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
                    n: {"seconds": runs, "median": median[n], "best": best[n]}
                    for n, runs in results.items()
                },
                "table": table,
            },
            indent=2,
        )
    )


def verdicts(best: dict[str, float]) -> list[str]:
    """One line per target: the measured ratio of best runs and whether it is met."""
    lines = []
    for name, base, bound, kind, what in TARGETS:
        if name not in best or base not in best:
            lines.append(f"- {what}: not measured in this run")
            continue
        if kind == "min":
            ratio = best[base] / best[name]
            met = ratio >= bound
            lines.append(f"- {what}: {ratio:.2f}x (target at least {bound}x): "
                         f"{'met' if met else 'NOT met'}")  # fmt: skip
        else:
            ratio = best[name] / best[base]
            met = ratio <= bound
            lines.append(f"- {what}: {ratio:.2f}x the time (target at most {bound}x): "
                         f"{'met' if met else 'NOT met'}")  # fmt: skip
    return lines


if __name__ == "__main__":
    main()
