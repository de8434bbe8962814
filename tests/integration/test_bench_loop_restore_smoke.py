"""Issue 27's benchmarks still run: the training loop's overhead beside DCP, restore
against the disk's read, and the GPU check (here without a GPU). Tiny states, one
repetition; the real runs are `make bench`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from support.common import REPO


def _run(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", *args],
        cwd=REPO,
        env=dict(os.environ, CKPTVAULT_BENCH_QUIET_SECONDS="0"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.heavy
@pytest.mark.extended  # a benchmark's smoke run: make test-extended
def test_the_loop_overhead_benchmark_runs_ckptvault_beside_dcp(tmp_path: Path):
    out = _run(
        "bench.loop_overhead", "--state-mb", "2", "--cadences", "0.1", "--saves", "1",
        "--steps-per-save", "2", "--reps", "1", "--contenders", "ckptvault-thread,dcp-thread",
        "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "loop.json"),
    )  # fmt: skip
    assert "| ckptvault-thread | 1 |" in out and "| dcp-thread | 1 |" in out
    assert "| none | 1 |" in out and "FAILED" not in out
    assert "<= DCP's best mode (dcp-thread), paired blocks" in out
    assert "0.1 s cadence, ckptvault-thread <= 1 %" in out


def test_the_restore_limit_benchmark_runs(tmp_path: Path):
    out = _run(
        "bench.restore_limit", "--size-gb", "0.01", "--reps", "1", "--evict", "fadvise",
        "--no-tmpfs", "--dir", str(tmp_path / "work"), "--out", str(tmp_path / "r.json"),
    )  # fmt: skip
    assert "| cold: plain read |" in out and "| cold: ckptvault restore (verified) |" in out
    assert "| warm: torch.load(weights_only)+load_state_dict |" in out
    assert "cold pages evicted by fadvise" in out
    assert "cold verified restore >= 0.9x the plain sequential read:" in out
    assert "warm verified restore >= 1.2x torch.load+load_state_dict" in out


def test_the_gpu_check_says_so_without_cuda_and_runs_its_code_on_cpu(tmp_path: Path, capsys):
    from bench import gpu_check

    if not torch.cuda.is_available():
        assert gpu_check.main([]) == 0
        assert "no CUDA device" in capsys.readouterr().out
    assert gpu_check.main(["--device", "cpu", "--quick", "--out", str(tmp_path / "g.json")]) == 0
    out = capsys.readouterr().out
    assert "NOT GPU figures" in out
    assert "| ckptvault restore into CUDA tensors |" in out and "bit-exact: yes" in out
    assert "| ckptvault async save stall, after prepare() |" in out
    assert gpu_check.main(["--device", "tpu"]) == 2


def test_the_loop_overhead_figures_are_the_extra_time_a_save_adds_over_its_cadence():
    from bench.loop_overhead import summarize, verdicts

    def run(save_blocks: list[float], plain_blocks: list[float], cpu: float = 0.0) -> dict:
        return {"wall_s": sum(save_blocks) + sum(plain_blocks), "save_blocks_s": save_blocks,
                "plain_blocks_s": plain_blocks, "saves": len(save_blocks), "stall_s": 0.0,
                "stall_max_s": 0.0, "drain_s": 0.0, "isolated_cpu_s": cpu}  # fmt: skip

    runs = {
        "none": [run([2.0, 2.0], [2.0, 2.0])],
        # each save adds 0.1 s to its 2 s block: 5 % at this cadence, by every measure
        "ckptvault-thread": [run([2.1, 2.1], [2.0, 2.0], cpu=0.1)],
        "dcp-thread": [run([2.2, 2.2], [2.0, 2.0], cpu=0.2)],
        "dcp-process": [{"contender": "dcp-process", "error": "exited -6 without a result"}],
    }
    summary = summarize(runs)
    mine = summary["ckptvault-thread"]
    assert round(mine["paired_median"], 6) == 0.05
    assert round(mine["separate_median"], 6) == 0.05 and round(mine["separate_best"], 6) == 0.05
    assert round(mine["cpu_bound"], 6) == 0.05
    assert "dcp-process" not in summary  # a failed run is reported, not measured
    lines = verdicts({2.0: summary}, slow=2.0)
    assert any(
        "<= DCP's best mode (dcp-thread), paired blocks" in v and v.endswith(": met") for v in lines
    )
    assert any("ckptvault-thread <= 1 %" in v and v.endswith("NOT met") for v in lines)
