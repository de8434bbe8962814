"""Fixtures every test may use; helpers live in the ``support`` package.

Tests import ``support.*`` (``tests`` is on pytest's ``pythonpath``), and so do the
worker scripts tests start as subprocesses: ``tests`` goes on ``PYTHONPATH`` here,
once, for every process a test starts.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.azurite_server import (  # noqa: F401  (Azure fixtures)
    azure_container,
    azure_env,
    azurite_endpoint,
)
from support.s3_server import s3_bucket, s3_endpoint  # noqa: F401  (S3 fixtures)
from support.seaweedfs_server import (  # noqa: F401  (SeaweedFS, and S3 tests run on both)
    each_s3_bucket,
    each_s3_endpoint,
    seaweedfs_endpoint,
    seaweedfs_env,
)

TESTS = Path(__file__).resolve().parent
# Two pytest workers share two cores: a torch that spreads each op over every core
# as well spin-waits against the other worker (the demo beside a busy core: 63 CPU-s,
# 48 with one thread). Every process a test starts inherits this; set it to override.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# The benchmarks' smoke runs (in this process and in the ones it starts) check that a
# benchmark runs, not what it measures: no settling sleeps, no system-wide sync or
# dropped page cache, which would slow every test running beside them.
os.environ.setdefault("CKPTVAULT_BENCH_QUIET_SECONDS", "0")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Heavy tests first (a stable sort): xdist hands tests out in this order, and a
    demo started last keeps one worker busy for a minute while the other idles."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)


@pytest.fixture(autouse=True)
def isolated_state_dir(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Ledger and audit log defaults live in a per-test state directory."""
    state = tmp_path_factory.mktemp("state")
    monkeypatch.setenv("XDG_STATE_HOME", str(state))
    return state / "ckptvault"


@pytest.fixture
def store(tmp_path: Path) -> Path:
    return tmp_path / "store"
