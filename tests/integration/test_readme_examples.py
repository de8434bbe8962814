"""The documented examples run as written, found by their headings in the README or
the docs pages (support.doc_pages): the DCP plugin snippet (and, after it, the same
calls on bad input raising ckptvault's errors), the torchrun example (two ranks,
then three resuming and resharding), the save-policy and heartbeat blocks, and the
Azure example and its Azurite commands."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support.common import REPO
from support.doc_pages import python_block_after as _python_block_after
from support.doc_pages import shell_block_after as _shell_block_after
from support.multirank import free_port

# Run after the documented DCP example, in its process: the same plain DCP calls on bad
# input raise ckptvault's own errors, with nothing wrapped around them.
_DCP_BAD_INPUT = """
import pathlib
try:
    dcp.save({**state, "hook": print},
             storage_writer=cv.dcp.StorageWriter("runs/dcp-demo", run_id="demo", step=101))
except cv.errors.UsageError as exc:
    print("save:", type(exc).__name__, "'hook'" in str(exc))
reader = cv.dcp.StorageReader("runs/dcp-demo", run_id="demo")  # its checks pass
[tensors] = pathlib.Path("runs/dcp-demo").glob("step-*/*.safetensors")
tensors.chmod(0o644)
data = bytearray(tensors.read_bytes())
data[-1] ^= 1  # damaged after the reader's checks
tensors.write_bytes(bytes(data))
try:
    dcp.load(state, storage_reader=reader)
except cv.errors.IntegrityError as exc:
    print("load:", type(exc).__name__)
"""


def test_the_dcp_plugin_example_runs_as_written(tmp_path: Path):
    code = _python_block_after("## Using ckptvault inside existing DCP code")
    result = subprocess.run(
        [sys.executable, "-c", code + _DCP_BAD_INPUT],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-3:] == [
        "100 True",
        "save: UsageError True",
        "load: IntegrityError",
    ]


def _torchrun(ranks: int, store: Path) -> str:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        f"--master_port={free_port()}",
        str(REPO / "demo" / "torchrun_example.py"),
        str(store),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=180, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.heavy
def test_the_torchrun_example_resumes_and_reshards(tmp_path: Path):
    store = tmp_path / "ckpt-torchrun"
    assert "started fresh; saved steps 1..3 from 2 ranks" in _torchrun(2, store)
    assert "resumed at step 3; saved steps 4..6 from 3 ranks" in _torchrun(3, store)


def test_the_save_policy_example_runs_as_written(tmp_path: Path):
    """The documented save-policy block: saves where its comment says, Planned logs."""
    code = _python_block_after("## Save policies")
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[-1] == "[200, 150, 100, 50]"
    assert "save policy Planned(mtbf_hours=50000, nodes=64): checkpoint interval" in result.stderr


def test_the_hang_watchdog_example_runs_as_written_and_reports_progress(tmp_path: Path):
    """The documented heartbeat block: it trains, saves at 50 and 100, and leaves the
    rank's progress record where a supervisor looks (CKPTVAULT_PROGRESS_DIR)."""
    code = _python_block_after("### Hang watchdog")
    env = dict(os.environ, CKPTVAULT_PROGRESS_DIR=str(tmp_path / "progress"))
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "progress" / "rank0.json").read_text())
    assert record["step"] == 100 and record["phase"] == "training"
    listed = sorted(p.name for p in (tmp_path / "runs" / "watched").glob("step-*"))
    assert len(listed) == 2


def test_the_azure_example_runs_as_written(azure_env: str, tmp_path: Path):
    from support.azurite_server import service_client

    service_client(azure_env).create_container("checkpoints")
    code = _python_block_after("## In Azure Blob Storage")
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == "100"


def test_the_azurite_try_it_commands_run_as_written(tmp_path: Path):
    """The shell lines that start Azurite and list a store, on a free port and in a
    temporary folder instead of the documented 10000 and /tmp/azurite."""
    script = _shell_block_after("## In Azure Blob Storage", "azurite-blob")
    script = script.replace("10000", str(free_port())).replace("/tmp/azurite", str(tmp_path))
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}"}
    env.pop("AZURE_STORAGE_CONNECTION_STRING", None)
    result = subprocess.run(
        ["bash", "-c", f"set -e\n{script}\nkill -KILL $!"],  # a TERMed Azurite lingers 2 min
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "no generations in az://checkpoints/run42" in result.stdout
