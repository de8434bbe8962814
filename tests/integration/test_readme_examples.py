"""The README's examples run as written: the DCP plugin snippet and the torchrun
example (two ranks, then three resuming and resharding)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from support.common import REPO
from support.multirank import free_port

README = REPO / "README.md"


def _python_block_after(heading: str) -> str:
    text = README.read_text()
    section = text[text.index(heading) :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, f"no python block after {heading!r}"
    return match.group(1)


def test_the_dcp_plugin_example_runs_as_written(tmp_path: Path):
    code = _python_block_after("### Using ckptvault inside existing DCP code")
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "100 True"


def _torchrun(ranks: int, store: Path) -> str:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        f"--master_port={free_port()}",
        str(REPO / "demo" / "torchrun_example.py"),
        str(store),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.heavy
def test_the_torchrun_example_resumes_and_reshards(tmp_path: Path):
    store = tmp_path / "ckpt-torchrun"
    assert "started fresh; saved steps 1..3 from 2 ranks" in _torchrun(2, store)
    assert "resumed at step 3; saved steps 4..6 from 3 ranks" in _torchrun(3, store)
