"""The demo is the product's main job end to end; it must keep working.

The test runs it with ``--quick``: every step and claim, on training runs a third as
long with as many saves (``make demo`` runs the full length).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from support.common import REPO


@pytest.mark.heavy
def test_demo_runs_and_proves_its_claims():
    result = subprocess.run(
        [sys.executable, str(REPO / "demo" / "demo.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "bit-identical" in out
    assert "skipped step" in out and "digest-mismatch" in out
    assert "exits 1" in out  # verify --all flags the damaged generation
    # Supervised, preempted twice and killed once: four attempts in the catalog, and
    # the same final weights as the uninterrupted run.
    assert out.count("bit-identical") == 2
    assert "attempt 1: exit 75 -> restart" in out and "attempt 2: SIGKILL -> restart" in out
    assert "attempt 4: exit 0 -> finish" in out and "supervisor exit 0" in out
