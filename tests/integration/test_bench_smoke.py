"""The benchmarks still run: a tiny state, one repetition, seconds (the real runs are
`make bench`). A benchmark that cannot run cannot keep the README's tables honest."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.common import REPO


def _run(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        # No pause for the disk to settle before each measurement: the smoke run checks
        # that the benchmark runs, not what it measures.
        env=dict(os.environ, CKPTVAULT_BENCH_QUIET_SECONDS="0"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.heavy
@pytest.mark.extended  # a benchmark's smoke run: make test-extended
def test_the_save_restore_benchmark_runs(tmp_path: Path):
    work, results = str(tmp_path / "work"), str(tmp_path / "results.json")
    out = _run(
        "bench.save_restore", "--size-gb", "0.01", "--reps", "1", "--dir", work, "--out", results
    )
    assert "| ckptvault save |" in out and "| ckptvault restore (verified) |" in out
    assert "| safetensors load_file+load_state_dict |" in out
    assert "| ckptvault async stall, first save after prepare() |" in out
    assert "Targets, judged on best runs:" in out and "x (target at" in out


@pytest.mark.extended  # a benchmark's smoke run: make test-extended
def test_the_multirank_benchmark_runs(tmp_path: Path):
    args = ["--size-gb", "0.02", "--ranks", "2", "--reps", "1", "--dir", str(tmp_path)]
    out = _run("bench.multirank_save", *args)
    assert "| ckptvault |" in out and "| DCP FileSystemWriter |" in out
