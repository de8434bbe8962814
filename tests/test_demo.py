"""The demo is the product's main job end to end; it must keep working."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO


def test_demo_runs_and_proves_its_claims():
    result = subprocess.run(
        [sys.executable, str(REPO / "demo" / "demo.py")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "bit-identical" in out
    assert "skipped step" in out and "digest-mismatch" in out
    assert "exits 1" in out  # verify --all flags the damaged generation
