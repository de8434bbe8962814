"""``bench/s3_save.py`` still runs: a tiny state, one repetition, on the session's
SeaweedFS, in this process (the real run, `make bench`, starts moto and SeaweedFS
of its own; a subprocess starting both took 14 s here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from support.common import REPO
from support.seaweedfs_server import SESSION_BUCKET

if str(REPO) not in sys.path:  # bench/ is a package at the repository root, not installed
    sys.path.insert(0, str(REPO))

from bench.s3_save import prepare, report, run_reps


def test_the_s3_save_benchmark_runs_on_seaweedfs(
    seaweedfs_env: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    state, nbytes, blob = prepare(0.001, 128, tmp_path)
    seconds = run_reps("seaweedfs", seaweedfs_env, SESSION_BUCKET, 1, blob, state, "bench/")
    report({"seaweedfs": seconds}, nbytes, 1)
    out = capsys.readouterr().out
    for contender in ("boto3 upload_file", "ckptvault S3 save"):
        assert f"| seaweedfs | {contender} |" in out, out
    assert "ckptvault S3 save >= 0.8x boto3 upload_file on SeaweedFS: " in out
