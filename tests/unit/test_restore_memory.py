"""A restore's private buffers go back to the system once the values are applied:
restoring a model leaves the process about as large as before, not twice the model."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from support.common import REPO


def test_restore_returns_its_buffers_to_the_system(tmp_path: Path):
    script = textwrap.dedent(
        f"""
        import gc
        import torch
        import ckptvault as cv

        def rss():
            with open("/proc/self/statm") as handle:
                return int(handle.read().split()[1]) * 4096

        model = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096))
        with cv.CheckpointManager({str(tmp_path / "store")!r}, run_id="r") as mgr:
            mgr.save(1, {{"model": model}})
        target = torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.Linear(4096, 4096))
        gc.collect()
        before = rss()
        with cv.CheckpointManager({str(tmp_path / "store")!r}, run_id="r") as mgr:
            mgr.restore({{"model": target}})
        gc.collect()
        assert torch.equal(target[1].weight, model[1].weight)
        print(rss() - before)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    grown = int(result.stdout.strip().splitlines()[-1])
    model_bytes = 2 * (4096 * 4096 + 4096) * 4  # 134 MB held privately during the restore
    assert grown < model_bytes // 4, f"the process kept {grown} bytes after the restore"
