"""The GPU check: one prepared script for a machine with a CUDA device.

    python -m bench.gpu_check [--size-gb 2] [--reps 5] [--dir bench-out/gpu]
    python -m bench.gpu_check --device cpu --quick     # the same code paths on CPU

With a model + AdamW state of about ``--size-gb`` GB on the GPU, interleaved over
``--reps`` repetitions with the contenders' order rotated, it measures:

- pinned staging: ckptvault's staging of the CUDA tensors into its (pinned) host
  buffers, after they are allocated (``StagingSlot.stage``), against a plain
  ``.cpu()`` of the same tensors (pageable memory, allocated each time) and a
  non-blocking copy into preallocated pinned buffers (the D2H limit); whether every
  staging buffer is pinned;
- the D2H stall of an asynchronous save: ``mgr.save(step, state, blocking=False)``
  after ``prepare`` (and with ``async_mode="process"`` where this ckptvault has it),
  against the plain ``.cpu()``; and how long the save takes to be durable;
- restore into CUDA tensors: ``mgr.restore`` into a freshly built model and optimizer
  on the GPU against ``torch.load(map_location="cuda", weights_only=True)`` +
  ``load_state_dict``, with the page cache warm, each checked bit for bit (outside
  the clock) against the saved state.

Prints a Markdown table for the README. On a machine without CUDA it says so and
exits 0 (``no CUDA device``); ``--device cpu`` runs the same code on CPU tensors to
check the script itself (those figures are not GPU figures, and say so).
Results go to ``bench-out/gpu_check.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.features import process_mode_available
from bench.measure import rotated, timed

Measurement = tuple[float, int]
WIDTH = 4096
CPU_COPY = "plain .cpu() of the state"
PINNED_COPY = "copy into preallocated pinned buffers"
STAGE = "ckptvault staging (StagingSlot.stage, buffers ready)"
STALL = "ckptvault async save stall, after prepare()"
STALL_PROCESS = "ckptvault async save stall, async_mode='process'"
DURABLE = "ckptvault async save, until durable"
RESTORE = "ckptvault restore into CUDA tensors"
TORCH_RESTORE = "torch.load(map_location)+load_state_dict"


def build(
    size_gb: float, device: torch.device, seed: int = 0
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model on ``device`` and its AdamW, without moments yet (a fresh job to
    restore into; :func:`take_a_step` makes them), of about ``size_gb`` GB of state."""
    torch.manual_seed(seed)
    width = WIDTH if size_gb >= 0.5 else 1024  # small states (the script's own check) stay small
    layers = max(1, int(size_gb * 1e9 / 12) // (width * width))
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    return model, opt


def take_a_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()
    opt.zero_grad(set_to_none=True)


def tensors_of(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    flat = {f"model.{k}": v for k, v in model.state_dict().items()}
    for pid, entry in opt.state_dict()["state"].items():
        for name, value in entry.items():
            flat[f"opt.{pid}.{name}"] = value
    return flat


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Check:
    """The state on the device and the contenders measured on it."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        self.model, self.opt = build(args.size_gb, device)
        take_a_step(self.model, self.opt)
        self.tensors = tensors_of(self.model, self.opt)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self.notes: dict[str, str] = {}
        self.durable: list[Measurement] = []  # the stall's saves, until durable
        self.exact: dict[str, list[bool]] = {}  # per restore contender, bit-exact or not

    def state(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.opt}

    def timed_sync(self, fn: Callable[[], object]) -> Measurement:
        """``fn``'s time including the device work it queued."""

        def run() -> None:
            fn()
            synchronize(self.device)

        synchronize(self.device)
        return timed(run)

    # -- staging ------------------------------------------------------------------------

    def staging(self) -> list[tuple[str, Callable[[], Measurement]]]:
        pin = self.device.type == "cuda"
        pinned = {
            k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pin) for k, v in self.tensors.items()
        }

        def cpu_copy() -> Measurement:  # on CPU tensors .cpu() copies nothing: clone
            copy = (lambda v: v.cpu()) if self.device.type == "cuda" else (lambda v: v.clone())
            return self.timed_sync(lambda: {k: copy(v) for k, v in self.tensors.items()})

        def pinned_copy() -> Measurement:
            return self.timed_sync(
                lambda: [pinned[k].copy_(v, non_blocking=True) for k, v in self.tensors.items()]
            )

        contenders = [(CPU_COPY, cpu_copy), (PINNED_COPY, pinned_copy)]
        try:
            from ckptvault.io.staging import StagingSlot

            slot = StagingSlot()
            slot.reserve(self.tensors, threading.Event())
            staged = slot.stage(self.tensors)
            all_pinned = all(t.is_pinned() for t in staged.values())
            pinned_note = ("yes" if all_pinned else "NO") if pin else "n/a on CPU"
            self.notes[STAGE] = f"every staging buffer pinned: {pinned_note}"
            contenders.append((STAGE, lambda: self.timed_sync(lambda: slot.stage(self.tensors))))
        except (ImportError, AttributeError, TypeError) as exc:  # its internals moved
            self.notes[STAGE] = f"not measured: {type(exc).__name__}: {exc}"
        return contenders

    # -- the async save's stall ------------------------------------------------------------

    def stalls(self, root: Path) -> list[tuple[str, Callable[[], Measurement]]]:
        import ckptvault as cv

        def stall(name: str, path: Path, **options: Any) -> Callable[[], Measurement]:
            def run() -> Measurement:
                shutil.rmtree(path, ignore_errors=True)
                with cv.CheckpointManager(path, run_id="gpu", async_save=True, **options) as mgr:
                    mgr.prepare(self.state(), wait=True)
                    mgr.save(0, self.state())  # the first save: warm the writer
                    mgr.wait()
                    result = timed(lambda: mgr.save(1, self.state()))
                    mgr.wait()
                    if not options:  # the same save again, on one clock until durable
                        started = time.perf_counter()
                        mgr.save(2, self.state())
                        mgr.wait()
                        self.durable.append((time.perf_counter() - started, 0))
                shutil.rmtree(path, ignore_errors=True)
                return result

            return run

        contenders = [(STALL, stall(STALL, root / "stall"))]
        if process_mode_available():
            contenders.append(
                (STALL_PROCESS, stall(STALL_PROCESS, root / "stall-process", async_mode="process"))
            )
        return contenders

    # -- restore into CUDA tensors ---------------------------------------------------------

    def restores(self, root: Path) -> list[tuple[str, Callable[[], Measurement]]]:
        import ckptvault as cv

        vault, torch_file = root / "restore-vault", root / "restore.pt"
        if not vault.exists():
            with cv.CheckpointManager(vault, run_id="gpu") as mgr:
                mgr.save(1, self.state())
            torch.save(
                {"model": self.model.state_dict(), "optimizer": self.opt.state_dict()}, torch_file
            )
        for file in [torch_file, *vault.rglob("*")]:  # warm: every page cached
            if file.is_file():
                file.read_bytes()

        def vault_restore(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
            with cv.CheckpointManager(vault, run_id="gpu") as mgr:
                if mgr.restore({"model": model, "optimizer": opt}) is None:
                    raise AssertionError(f"no generation in {vault}")

        def torch_restore(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
            loaded = torch.load(torch_file, map_location=self.device, weights_only=True)
            model.load_state_dict(loaded["model"])
            opt.load_state_dict(loaded["optimizer"])

        def measure(name: str, restore: Callable[..., None]) -> Callable[[], Measurement]:
            def run() -> Measurement:
                model, opt = build(self.args.size_gb, self.device, seed=1)
                result = self.timed_sync(lambda: restore(model, opt))
                restored = tensors_of(model, opt)
                exact = all(
                    restored[k].device.type == self.device.type and torch.equal(restored[k], v)
                    for k, v in self.tensors.items()
                )
                self.exact.setdefault(name, []).append(exact)
                return result

            return run

        return [
            (RESTORE, measure(RESTORE, vault_restore)),
            (TORCH_RESTORE, measure(TORCH_RESTORE, torch_restore)),
        ]

    def run(self, root: Path) -> dict[str, list[Measurement]]:
        results: dict[str, list[Measurement]] = {}
        phases = [self.staging, lambda: self.stalls(root), lambda: self.restores(root)]
        for rep in range(self.args.reps):
            print(f"repetition {rep + 1}/{self.args.reps}", flush=True)
            for phase in rotated(phases):
                for name, measure in rotated(phase()):
                    results.setdefault(name, []).append(measure())
        if self.durable:
            results[DURABLE] = self.durable
        return results


# -- the report ---------------------------------------------------------------------------


def baseline(name: str) -> tuple[str, str]:
    if name in (RESTORE, TORCH_RESTORE):
        return TORCH_RESTORE, "x torch.load speed"
    return CPU_COPY, "x .cpu() time"


def report(
    check: Check,
    results: dict[str, list[Measurement]],
    device: torch.device,
    args: argparse.Namespace,
) -> str:
    median = {n: statistics.median(s for s, _ in r) for n, r in results.items()}
    best = {n: min(s for s, _ in r) for n, r in results.items()}
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)}, CUDA {torch.version.cuda}"
    else:
        where = "CPU tensors (--device cpu: a check of the script, NOT GPU figures)"
    lines = [
        f"State: {check.nbytes / 1e9:.2f} GB (model + AdamW) on {where}; {args.reps} interleaved "
        f"runs; torch {torch.__version__}, {platform.machine()}, {os.cpu_count()} cores.",
        "",
        "| operation | median s | best s | GB/s (median) | ratio (medians) | ratio (best runs) | note |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    for name in results:
        base, unit = baseline(name)
        if name == DURABLE:  # no peer: how long the background part takes
            lines.append(f"| {name} | {median[name]:.4f} | {best[name]:.4f} | "
                         f"{check.nbytes / median[name] / 1e9:.2f} | | | stall + wait |")  # fmt: skip
            continue
        if unit == "x .cpu() time":  # smaller is better: this time over the copy's
            ratios = (median[name] / median[base], best[name] / best[base])
        else:  # torch s / this s: this one's speed over torch's
            ratios = (median[base] / median[name], best[base] / best[name])
        note = check.notes.get(name, "")
        if name in check.exact:
            note = f"bit-exact: {'yes' if all(check.exact[name]) else 'NO'} ({len(check.exact[name])} runs)"
        lines.append(
            f"| {name} | {median[name]:.4f} | {best[name]:.4f} | {check.nbytes / median[name] / 1e9:.2f} "
            f"| {ratios[0]:.2f} {unit} | {ratios[1]:.2f} | {note} |"
        )
    return "\n".join(lines)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument(
        "--device", default="cuda", help="cuda (default), cuda:N, or cpu to check the script"
    )
    parser.add_argument("--dir", type=Path, default=None, help="default: a temporary directory")
    parser.add_argument("--out", type=Path, default=Path("bench-out/gpu_check.json"))
    parser.add_argument("--quick", action="store_true", help="0.02 GB, 1 repetition")
    args = parser.parse_args(argv)
    if args.quick:
        args.size_gb, args.reps = 0.02, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:
        device = torch.device("meta")  # refused just below
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: bench.gpu_check measures nothing on this machine "
              "(run it where a GPU is lent; --device cpu checks the script itself)")  # fmt: skip
        return 0
    if device.type not in ("cuda", "cpu"):
        print(f"--device must be cuda, cuda:N or cpu, not {args.device!r}", file=sys.stderr)
        return 2
    state_home = tempfile.mkdtemp(prefix="ckptvault-gpu-state-")
    os.environ["XDG_STATE_HOME"] = state_home  # this check's catalog, not the user's
    root = args.dir or Path(tempfile.mkdtemp(prefix="ckptvault-gpu-"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        check = Check(args, device)
        results = check.run(root)
    finally:
        shutil.rmtree(state_home, ignore_errors=True)
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    text = report(check, results, device, args)
    print()
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "device": str(device), "bytes": check.nbytes, "reps": args.reps, "table": text,
        "results": {n: {"seconds": r, "median": statistics.median(s for s, _ in r)}
                    for n, r in results.items()},
    }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
