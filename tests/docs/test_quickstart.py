"""The README's quickstart runs as written: the first run dies of its SIGKILL, the
second resumes from the newest checkpoint that verifies and ends with exactly the
loss of a run that was never killed, and the CLI lines after it work."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from support.common import REPO, run_cli

KILL_LINE = "os.kill(os.getpid(), signal.SIGKILL)"


def quickstart() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Quickstart") :]
    match = re.search(r"^```python[^\n]*\n(.*?)^```", section, re.S | re.M)
    assert match is not None, "the README's Quickstart has no python block"
    return match.group(1)


def run(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    (cwd / "quickstart.py").write_text(script)
    return subprocess.run(
        [sys.executable, "quickstart.py"], cwd=cwd, capture_output=True, text=True, timeout=180
    )


def test_the_quickstart_dies_resumes_and_ends_as_an_uninterrupted_run(tmp_path: Path):
    script = quickstart()
    assert KILL_LINE in script
    killed, resumed = tmp_path / "killed", tmp_path / "never-killed"
    killed.mkdir()
    resumed.mkdir()
    first = run(script, killed)
    assert first.returncode == -signal.SIGKILL, first.stderr[-2000:]
    assert "starting at step 0" in first.stdout
    second = run(script, killed)
    assert second.returncode == 0, second.stderr[-2000:]
    assert "starting at step 16" in second.stdout
    baseline = run(script.replace(KILL_LINE, "pass"), resumed)
    assert baseline.returncode == 0, baseline.stderr[-2000:]
    final = second.stdout.strip().splitlines()[-1]
    assert final.startswith("finished at step 29") and final == baseline.stdout.strip().splitlines()[-1]
    listed = run_cli("ls", str(killed / "runs" / "quickstart"), "--json")
    assert listed.returncode == 0 and '"step": 25' in listed.stdout
    assert run_cli("verify", str(killed / "runs" / "quickstart"), "--all").returncode == 0
