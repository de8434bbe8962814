"""Bit-exact resume: a fresh process that restores step k continues exactly like the
uninterrupted run — losses, batches, dropout masks, weights, optimizer state, LR."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parents[1] / "support" / "resume_worker.py"


def _run(*args: str) -> None:
    result = subprocess.run(
        [sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr


def _records(path: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, path.read_text().splitlines())}


@pytest.mark.heavy
def test_resume_in_a_fresh_process_is_bit_exact(tmp_path: Path):
    store = tmp_path / "store"
    steps, every = 40, 10
    _run("full", str(store), str(steps), str(every), str(tmp_path / "full.jsonl"), "0")
    full = _records(tmp_path / "full.jsonl")
    assert len(full) == steps
    # Resume from two different points; saves happened after steps 9, 19, 29, 39.
    for saved_step in (9, 19):
        out = tmp_path / f"resume{saved_step}.jsonl"
        _run("resume", str(store), str(steps), str(saved_step), str(out), "12345")
        resumed = _records(out)
        assert sorted(resumed) == list(range(saved_step + 1, steps))
        for step, record in resumed.items():
            assert record == full[step], f"diverged at step {step} after resuming from {saved_step}"
    # The records are not trivially equal: training moved the weights and the LR.
    assert full[10]["weights"] != full[39]["weights"] and full[10]["lr"] != full[39]["lr"]
    assert full[10]["mask"] != full[11]["mask"]
