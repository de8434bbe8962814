"""Running a documented example as written, in a fresh process, for the integration tests.

A test hands :func:`run_example` the example's block (from :func:`readme_block`: the
README's or a documentation page's, found by its heading) and
a harness: code that runs the block (``exec``, in a working directory of its
choosing), arms a SIGKILL at some step or dumps what the run produced. The process
gets bit-reproducible kernels, as the docs ask of a run that must resume exactly:
``MKL_CBWR=COMPATIBLE`` and one thread.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from support.doc_pages import python_block_after

PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".pickle")


def readme_block(heading: str) -> str:
    """The first ```python block after ``heading``, in the README or the docs page
    that holds that heading (:func:`support.doc_pages.python_block_after`)."""
    return python_block_after(heading)


def run_example(harness: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, MKL_CBWR="COMPATIBLE", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env.pop("PYTHONHASHSEED", None)
    return subprocess.run(
        [sys.executable, "-c", harness],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def assert_killed(result: subprocess.CompletedProcess) -> None:
    """The run died of the SIGKILL its harness armed (not of an error of its own)."""
    assert result.returncode == -signal.SIGKILL, (result.returncode, result.stderr[-3000:])


def pickled_files(root: Path) -> list[Path]:
    """Files under ``root`` with the names torch.save / pickle output gets."""
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in PICKLE_SUFFIXES)
