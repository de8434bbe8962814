"""One run of the training loop for :mod:`bench.loop_overhead`, in a fresh process.

    python -m bench.loop_worker SPEC.json

The spec (JSON) names a contender, the state's size, how many save blocks the timed
loop runs and how many steps a block has; the result (JSON) is written to the spec's
``result`` path before the process exits, so that an abort in the interpreter's
teardown (torch 2.13's DCP ``async_save`` leaves one about one exit in twenty) costs
nothing that was measured.

Every contender runs the same loop: a real MLP + AdamW on CPU, a forward, a
backward and an optimizer step per step, on batches made before the clock starts.
Before the timed loop each contender takes one warm-up save and waits for it, so
the timed loop measures the steady state (staging buffers allocated, DCP's
checkpoint process spawned); the warm-up's seconds are reported as ``setup_s``.

The timed loop is ``2 x saves`` blocks of K steps, a save block and a plain block in
turn. A save block starts with a save and ends once that save is durable (its wait,
``drain``, is inside the block): the whole cost of a save, stall and background,
lands in its own block, as in a loop that saves every K steps with one save in
flight. The plain blocks are the same loop without checkpoints, measured in the same
process a few seconds apart, so that a slow drift in the machine's load cancels out;
``none`` takes no save in any block (its blocks measure the pairing's noise).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

WIDTH = 1024
BATCH = 64


@dataclass
class Spec:
    """What one run does (the JSON the parent writes)."""

    contender: str
    state_mb: float
    saves: int  # save blocks in the timed loop (as many plain blocks)
    every: int  # steps per block
    directory: str  # where this run's checkpoints go
    result: str  # where the result JSON goes
    calibrate_s: float = 0.0  # > 0: no saves; time steps for about this long
    threads: int = 0  # torch's intra-op threads for the loop (0: torch's default, every core)


def build(state_mb: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """An MLP of WIDTH x WIDTH layers + AdamW whose state (weights, biases and the two
    moments) is about ``state_mb`` MB, with the moments made by one step."""
    torch.manual_seed(0)
    layers = max(1, round(state_mb * 1e6 / (12 * WIDTH * WIDTH)))
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks[:-1])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    return model, opt


def state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for entry in opt.state.values():
        total += sum(v.numel() * v.element_size() for v in entry.values() if torch.is_tensor(v))
    return total


class Trainer:
    """The loop's body: one forward, backward and optimizer step on a ready batch."""

    def __init__(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model, self.opt = model, opt
        generator = torch.Generator().manual_seed(1)
        self.batches = [
            (
                torch.randn(BATCH, WIDTH, generator=generator),
                torch.randn(BATCH, WIDTH, generator=generator),
            )
            for _ in range(8)
        ]
        self.count = 0

    def step(self) -> None:
        inputs, target = self.batches[self.count % len(self.batches)]
        self.count += 1
        loss = torch.nn.functional.mse_loss(self.model(inputs), target)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


# -- the savers: each is (save(step) -> None, drain() -> None, close() -> None) ---------


@dataclass
class Saver:
    save: Callable[[int], None]
    drain: Callable[[], None]
    close: Callable[[], None]


def no_saver() -> Saver:
    nothing = lambda *_: None  # noqa: E731
    return Saver(nothing, nothing, nothing)


def ckptvault_saver(spec: Spec, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Saver:
    """ckptvault's asynchronous saves, as the README shows them: ``async_save=True``,
    ``prepare`` once the optimizer has its moments; ``ckptvault-process`` adds
    ``async_mode="process"`` (the writer process)."""
    import ckptvault as cv

    options: dict[str, Any] = {"run_id": "bench-loop", "async_save": True}
    if spec.contender == "ckptvault-process":
        options["async_mode"] = "process"
    mgr = cv.CheckpointManager(spec.directory, **options)
    state = {"model": model, "optimizer": opt}
    mgr.prepare(state, wait=True)

    def save(step: int) -> None:
        mgr.save(step, state)

    return Saver(save, mgr.wait, mgr.close)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def dcp_saver(spec: Spec, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Saver:
    """DCP's ``async_save`` to a ``FileSystemWriter`` (its defaults: every file
    fsync'd), in the mode the contender names:

    - ``dcp-thread``: the thread executor, the writer stages (a fresh copy per save);
    - ``dcp-thread-cached``: the same with a kept ``DefaultStager``, whose cached
      buffers are reused by every save (as ckptvault's staging buffers are);
    - ``dcp-process``: ``AsyncCheckpointerType.PROCESS``, a spawned checkpoint
      process; the staged copy crosses to it through shared memory;
    - ``dcp-process-cached``: the same with a kept ``DefaultStager`` that stages into
      cached shared-memory buffers (the torch docs' zero-overhead recipe, less its
      CUDA-only pinned and asynchronous staging).

    The process mode needs a process group in the trainer (its checkpoint process
    joins one of its own): one gloo rank on 127.0.0.1, made here for every DCP mode
    so that they run alike.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the checkpoint process's rendezvous
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    process = spec.contender.startswith("dcp-process")
    kind = AsyncCheckpointerType.PROCESS if process else AsyncCheckpointerType.THREAD
    stager = None
    if spec.contender.endswith("-cached"):
        stager = DefaultStager(StagingOptions(False, process, False, False))
    pending: list[Any] = []

    def drain() -> None:
        while pending:
            pending.pop().result()

    def save(step: int) -> None:
        drain()  # one save in flight at most, as ckptvault's max_in_flight=1
        model_sd, optim_sd = get_state_dict(model, opt)
        writer = dcp.FileSystemWriter(str(Path(spec.directory, f"step-{step}")))
        response = dcp.async_save(
            {"model": model_sd, "optim": optim_sd},
            storage_writer=writer,
            async_checkpointer_type=kind,
            async_stager=stager,
        )
        pending.append(getattr(response, "upload_completion", response))

    def close() -> None:
        drain()
        if stager is not None:
            stager.close()
        dist.destroy_process_group()

    return Saver(save, drain, close)


SAVERS: dict[str, Callable[[Spec, torch.nn.Module, torch.optim.Optimizer], Saver]] = {
    "none": lambda spec, model, opt: no_saver(),
    "ckptvault-thread": ckptvault_saver,
    "ckptvault-process": ckptvault_saver,
    "dcp-thread": dcp_saver,
    "dcp-thread-cached": dcp_saver,
    "dcp-process": dcp_saver,
    "dcp-process-cached": dcp_saver,
}


# -- the run ------------------------------------------------------------------------------


def calibrate(trainer: Trainer, seconds: float) -> dict[str, Any]:
    """Seconds per step: the median of steps timed for about ``seconds``."""
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        started = time.perf_counter()
        trainer.step()
        times.append(time.perf_counter() - started)
    times.sort()
    return {"step_s": times[len(times) // 2], "steps": len(times)}


def timed_loop(spec: Spec, trainer: Trainer, saver: Saver) -> dict[str, Any]:
    save_blocks: list[float] = []
    plain_blocks: list[float] = []
    stalls: list[float] = []
    drains: list[float] = []
    for block in range(2 * spec.saves):
        started = time.perf_counter()
        saving = block % 2 == 0
        if saving:
            saver.save(block // 2 + 1)
            stalls.append(time.perf_counter() - started)
        for _ in range(spec.every):
            trainer.step()
        if saving:
            before = time.perf_counter()
            saver.drain()
            drains.append(time.perf_counter() - before)
        (save_blocks if saving else plain_blocks).append(time.perf_counter() - started)
    return {
        "wall_s": sum(save_blocks) + sum(plain_blocks),
        "save_blocks_s": save_blocks,
        "plain_blocks_s": plain_blocks,
        "saves": len(stalls),
        "stall_s": sum(stalls),
        "stall_max_s": max(stalls, default=0.0),
        "drain_s": sum(drains),
    }


def tree_cpu_s() -> float:
    """CPU seconds (user + system) of this process and every live descendant (a
    writer process, DCP's checkpoint process), from ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        parent[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    total, todo = 0.0, [os.getpid()]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo += [child for child, ppid in parent.items() if ppid == pid]
    return total


def isolated_saves(saver: Saver, first_step: int, count: int = 3) -> dict[str, float]:
    """Saves with no training beside them: the CPU seconds each costs the machine (all
    threads and helper processes) and its time until durable; medians. Unlike wall
    time in a loop, these do not depend on what else the machine runs."""
    cpus, walls = [], []
    for index in range(count):
        time.sleep(0.2)  # the last one's stragglers (a child's exit, logging) are done
        cpu, started = tree_cpu_s(), time.perf_counter()
        saver.save(first_step + index)
        saver.drain()
        walls.append(time.perf_counter() - started)
        cpus.append(tree_cpu_s() - cpu)
    cpus.sort()
    walls.sort()
    return {"isolated_cpu_s": cpus[count // 2], "isolated_wall_s": walls[count // 2]}


def run(spec: Spec) -> dict[str, Any]:
    if spec.threads:
        torch.set_num_threads(spec.threads)
    model, opt = build(spec.state_mb)
    trainer = Trainer(model, opt)
    for _ in range(3):  # the moments exist, the allocator is warm
        trainer.step()
    result: dict[str, Any] = {"contender": spec.contender, "bytes": state_bytes(model, opt)}
    result["threads"] = torch.get_num_threads()
    if spec.calibrate_s > 0:
        return {**result, **calibrate(trainer, spec.calibrate_s)}
    saver = SAVERS[spec.contender](spec, model, opt)
    try:
        started = time.perf_counter()
        saver.save(0)  # the warm-up save: buffers allocated, processes spawned
        saver.drain()
        result["setup_s"] = time.perf_counter() - started
        result.update(timed_loop(spec, trainer, saver))
        result.update(isolated_saves(saver, spec.saves + 1))
    finally:
        saver.close()
    return result


def main() -> None:
    spec = Spec(**json.loads(Path(sys.argv[1]).read_text()))
    try:
        result = run(spec)
    except Exception as exc:  # the parent reports it and goes on with the others
        result = {"contender": spec.contender, "error": f"{type(exc).__name__}: {exc}"}
    Path(spec.result).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    main()
