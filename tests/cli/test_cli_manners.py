"""Command-line habits a new user runs into (issue 28, item 4): ``--version``, help
that agrees with the defaults it shows, exit codes for things that are not there,
``status`` of a finished run, Ctrl-C, and errors in the command line's words."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault._version import __version__
from ckptvault.cli import main
from ckptvault.ops.done import manifest_digest, write_done_record
from ckptvault.ops.supervise import Policy
from ckptvault.storage import open_store
from support.common import run_cli


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"ckptvault {__version__}\n"


def test_supervise_help_says_the_default_restart_budget_it_shows():
    result = run_cli("supervise", "--help", env={"COLUMNS": "250"})
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert Policy().max_restarts == 2
    assert "[default: 2]" in text and "default 2 restarts: 3 attempts" in text
    assert not re.search(r"default 3\b(?! attempts)", text), text


@pytest.fixture
def finished_run(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A run that saved three steps and wrote its DONE record: store, ledger, record."""
    store, ledger, done = tmp_path / "store", tmp_path / "ctl" / "ledger", tmp_path / "DONE.json"
    with cv.CheckpointManager(store, run_id="r", ledger=ledger) as mgr:
        for step in (1, 2, 3):
            handle = mgr.save(step, {"model": torch.nn.Linear(2, 2)})
    last = handle.result().generation_id
    write_done_record(
        done,
        run_id="r",
        step=3,
        generation_id=last,
        manifest_digest=manifest_digest(open_store(store), last),
        config_digest="0" * 64,
        tokens=100,
    )
    return store, ledger, done


def test_status_of_a_finished_run_says_finished_and_exits_0(finished_run):
    store, ledger, done = finished_run
    # A cadence of a millisecond: without the record the last checkpoint is stale.
    args = ["status", store, "--ledger", ledger, "--cadence-seconds", "0.001"]
    stale = run_cli(*args)
    assert stale.returncode == 1 and "CkptvaultCheckpointStale" in stale.stderr
    result = run_cli(*args, "--done-file", done)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^finished +step 3 \(", result.stdout, re.M)
    assert result.stdout.rstrip().endswith("finished") and "Stale" not in result.stderr
    report = json.loads(run_cli(*args, "--done-file", done, "--json").stdout)
    assert report["finished"]["step"] == 3 and report["healthy"] is True


def test_status_refuses_a_done_record_that_is_missing_or_not_this_stores(finished_run, tmp_path):
    store, ledger, done = finished_run
    missing = run_cli("status", store, "--ledger", ledger, "--done-file", tmp_path / "none")
    assert missing.returncode == 2 and "no DONE record there" in missing.stderr
    other = tmp_path / "other"
    with cv.CheckpointManager(other, run_id="r", catalog=False) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(2, 2)})
    wrong = run_cli("status", other, "--ledger", ledger, "--done-file", done)
    assert wrong.returncode == 2 and "does not match store" in wrong.stderr


def test_exit_codes_for_what_is_not_there(finished_run, tmp_path):
    store, ledger, _ = finished_run
    keys = run_cli("keys", "list", "--keystore", tmp_path / "missing")
    assert keys.returncode == 2 and "no key store directory" in keys.stderr
    catalog = run_cli("catalog", "--ledger", ledger, "--store", tmp_path / "missing")
    assert catalog.returncode == 2 and catalog.stdout == ""
    assert f"it records {store}" in catalog.stderr
    # A folder of stores is not a store: say so, name them, exit 2.
    for args in ([], ["--json"]):
        folder = run_cli("ls", tmp_path, *args)
        assert folder.returncode == 2 and folder.stdout == "", folder.stdout
        assert "is not a store but holds 1 store(s): store" in folder.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_cli("ls", empty).stdout == f"no generations in {empty}\n"
    assert run_cli("ls", empty, "--json").stdout == "[]\n"


def _ckptvault(*args: object, imports: bool = False) -> subprocess.Popen[str]:
    # -X importtime: the interpreter says (on stderr) each import it finished.
    options = ["-X", "importtime"] if imports else []
    command = [sys.executable, *options, "-m", "ckptvault", *map(str, args)]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _said(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if not line.startswith("import time:")]


def test_ctrl_c_during_start_up_prints_one_line_and_exits_130(tmp_path):
    process = _ckptvault("ls", tmp_path, imports=True)
    assert process.stderr is not None
    for line in process.stderr:  # until typer is in: the rest of the CLI is being imported
        if line.split()[-1:] == ["typer"]:
            break
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130 and _said(err) == ["interrupted"], err[-2000:]
    assert out == ""


def test_ctrl_c_during_an_export_leaves_no_file_behind(tmp_path):
    store, out = tmp_path / "store", tmp_path / "out"
    out.mkdir()
    with cv.CheckpointManager(store, run_id="r", catalog=False) as mgr:
        mgr.save(1, {"model": {f"w{i}": torch.rand(8 << 20) for i in range(4)}})  # 128 MiB
    process = _ckptvault("export", store, "--out", out / "w.safetensors")
    deadline = time.monotonic() + 60
    while process.poll() is None and not any(out.iterdir()):  # the export began writing
        assert time.monotonic() < deadline, "the export never began writing"
        time.sleep(0.001)
    process.send_signal(signal.SIGSTOP)  # held mid-write while the Ctrl-C is queued
    process.send_signal(signal.SIGINT)
    process.send_signal(signal.SIGCONT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, (process.returncode, _said(err))
    assert _said(err) == ["interrupted"]
    assert list(out.iterdir()) == []  # neither the file nor its temporary


def test_s3_without_credentials_says_where_boto3_looks(s3_bucket, s3_endpoint):
    """A real S3 server answers; boto3 has no credentials to sign with."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_DEFAULT_REGION="us-east-1")
    env.update(AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull)
    result = subprocess.run(
        [sys.executable, "-m", "ckptvault", "ls", f"s3://{s3_bucket}/run",
         "--s3-endpoint-url", s3_endpoint],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line.startswith("ckptvault: error: ") and "[Errno" not in line
    for place in (
        "NoCredentialsError",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_PROFILE",
        "~/.aws/credentials",
        "metadata",
        "--s3-endpoint-url",
        "AWS_ENDPOINT_URL",
        f"(now {s3_endpoint})",
    ):
        assert place in line, (place, line)


@pytest.mark.parametrize(
    ("args", "said", "unsaid"),
    [
        (["gc", "{store}", "--keep-last", "0"], ["--keep-last", "1 or more"], ["int", "None"]),
        (["export", "{store}", "--out", "{tmp}"], ["--out", "is a directory"], [".tmp", "out="]),
        (["consolidate", "{store}", "{store}/hf"], ["outside it"], ["out_dir", "out="]),
    ],
    ids=["keep-last", "export-out", "consolidate-out"],
)
def test_errors_in_plain_words(finished_run, tmp_path, args, said, unsaid):
    store = finished_run[0]
    result = run_cli(*(a.format(store=store, tmp=tmp_path) for a in args))
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    for words in said:
        assert words in result.stderr, (words, result.stderr)
    for words in unsaid:
        assert words not in result.stderr, (words, result.stderr)
