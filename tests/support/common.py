"""What most tests share: a small training state, the CLI run as a user runs it, paths and file helpers."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from subprocess import CompletedProcess

import numpy as np
import pytest
import torch

import ckptvault as cv

REPO = Path(__file__).resolve().parents[2]


class TinyNet(torch.nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, width)
        self.drop = torch.nn.Dropout(0.25)
        self.norm = torch.nn.BatchNorm1d(width)
        self.fc2 = torch.nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(self.drop(torch.relu(self.fc1(x)))))


def make_training_state(seed: int = 0, width: int = 16) -> dict:
    torch.manual_seed(seed)
    model = TinyNet(width)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "sampler_rng": np.random.default_rng(seed),
        "rng": cv.RNGState(),
        "meta": {"tokens_seen": 0, "history": []},
    }


def train_steps(state: dict, steps: int) -> None:
    model, opt, sched = state["model"], state["optimizer"], state["scheduler"]
    for _ in range(steps):
        idx = state["sampler_rng"].integers(0, 1000, size=4)
        x = torch.randn(4, 8) + torch.tensor(idx, dtype=torch.float32)[:, None] / 1000
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        sched.step()
        state["meta"]["tokens_seen"] += 4
        state["meta"]["history"].append(loss.item())


def model_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# Commands that start processes, handle signals or change process-wide state: always
# in a process of their own.
_OWN_PROCESS = frozenset({"supervise", "drill"})


def run_cli(
    *args: str, timeout: float = 120, env: dict | None = None, process: bool = False
) -> CompletedProcess:
    """Run ``ckptvault ARGS`` as a user would, and what it printed and returned.

    In this process by default: the typer app's ``main`` with stdout and stderr
    captured (not terminals, as through a pipe) and the warnings the library logs on
    stderr, as a fresh process shows them; it costs no interpreter start and import.
    In a real subprocess (``python -m ckptvault``) with ``process=True``, with ``env``
    (the console reads COLUMNS and friends once, at import), and for the commands in
    ``_OWN_PROCESS``: the tests of exit codes, tracebacks, import cost and pipes use it.
    """
    if process or env is not None or (args and args[0] in _OWN_PROCESS):
        return run_cli_process(*args, timeout=timeout, env=env)
    from ckptvault.cli import main

    stdout, stderr = io.StringIO(), io.StringIO()
    logger = logging.getLogger("ckptvault")
    handler = logging.StreamHandler(stderr)  # what logging's last resort does in a process
    handler.setLevel(logging.WARNING)
    propagate = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main([str(arg) for arg in args])
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
    return CompletedProcess(["ckptvault", *args], code, stdout.getvalue(), stderr.getvalue())


def run_cli_process(*args: str, timeout: float = 120, env: dict | None = None) -> CompletedProcess:
    """Run the installed ``ckptvault`` command in a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "ckptvault", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, options: str) -> Iterator[Path]:
    """A size-limited tmpfs at ``mount_point`` for the duration; skips the test where
    mounting is not allowed (it needs root or CAP_SYS_ADMIN)."""
    mount_point.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mount_point)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {result.stderr.decode().strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def only_tensor_file(generation: Path) -> Path:
    files = sorted(generation.glob("*.safetensors"))
    assert files, f"no tensor files in {generation}"
    return files[0]


def writable(path: Path) -> Path:
    """Published files are read-only; tamper tests make them writable first."""
    path.chmod(0o644)
    return path

