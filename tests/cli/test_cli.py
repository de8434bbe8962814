"""The command line: ls, inspect and verify, as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from support.common import make_training_state, only_tensor_file, run_cli, train_steps, writable


@pytest.fixture
def populated(store: Path) -> list[cv.GenerationInfo]:
    state = make_training_state()
    with cv.CheckpointManager(store, run_id="cli", contract={"dataset": "ds-v3"}) as mgr:
        for step in (10, 20, 30):
            train_steps(state, 1)
            mgr.save(step, state)
        return mgr.generations()


def test_ls_json_is_pure_and_complete(store: Path, populated):
    result = run_cli("ls", str(store), "--json")
    assert result.returncode == 0, result.stderr
    listed = json.loads(result.stdout)  # nothing but JSON on stdout
    assert [g["step"] for g in listed] == [30, 20, 10]
    for entry, info in zip(listed, populated, strict=True):
        assert entry["generation_id"] == info.generation_id
        assert entry["path"] == info.path and Path(entry["path"]).is_absolute()
        assert entry["bytes"] == info.bytes and entry["created_at"] == info.created_at


def test_ls_paths_follow_the_store_when_moved(tmp_path: Path, store: Path, populated):
    moved = tmp_path / "elsewhere"
    store.rename(moved)
    listed = json.loads(run_cli("ls", str(moved), "--json").stdout)
    assert all(entry["path"].startswith(str(moved)) for entry in listed)


def test_ls_human_output(store: Path, populated):
    result = run_cli("ls", str(store))
    assert result.returncode == 0
    assert "30" in result.stdout and populated[0].generation_id[:8] in result.stdout


def test_inspect_shows_tensors_leaves_contract_files(store: Path, populated):
    result = run_cli("inspect", str(store), "--step", "20", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["generation"]["step"] == 20
    tensors = {row["key"]: row for row in report["tensors"]}
    expected = {"key": "model/fc1.weight", "dtype": "float32", "shape": [16, 8], "bytes": 512}
    assert tensors["model/fc1.weight"] == expected
    assert report["state"]["model"]["$stateful"]["kind"] == "module"
    assert report["contract"]["fields"]["dataset"] == "ds-v3"
    assert all(name.endswith(".safetensors") for name in report["files"])
    human = run_cli("inspect", str(store))
    assert human.returncode == 0 and "model/fc1.weight" in human.stdout and "ds-v3" in human.stdout


def test_verify_newest_all_and_step(store: Path, populated):
    assert run_cli("verify", str(store)).returncode == 0
    assert run_cli("verify", str(store), "--all").returncode == 0
    result = run_cli("verify", str(store), "--step", "10", "--json")
    assert result.returncode == 0
    report = json.loads(result.stdout)
    assert [r["step"] for r in report] == [10] and report[0]["ok"] and report[0]["problems"] == []


def test_verify_reports_each_failing_file_and_exits_nonzero(store: Path, populated):
    damaged = Path(populated[1].path)  # step 20
    data = bytearray(only_tensor_file(damaged).read_bytes())
    data[-5] ^= 0xFF
    writable(only_tensor_file(damaged)).write_bytes(bytes(data))
    (damaged / "stray.txt").write_bytes(b"x")
    assert run_cli("verify", str(store)).returncode == 0  # the newest is intact
    result = run_cli("verify", str(store), "--all")
    assert result.returncode == 1
    assert "FAIL" in result.stdout and "stray.txt" in result.stdout
    report = json.loads(run_cli("verify", str(store), "--all", "--json").stdout)
    bad = [r for r in report if not r["ok"]]
    assert [r["step"] for r in bad] == [20]
    assert {p["code"] for p in bad[0]["problems"]} == {"file-extra"}
    (damaged / "stray.txt").unlink()
    report = json.loads(run_cli("verify", str(store), "--step", "20", "--json").stdout)
    assert report[0]["problems"][0]["code"] == "digest-mismatch"
    assert report[0]["problems"][0]["file"] == only_tensor_file(damaged).name


def test_verify_checks_run_id_when_asked(store: Path, populated):
    assert run_cli("verify", str(store), "--run-id", "cli").returncode == 0
    result = run_cli("verify", str(store), "--run-id", "other", "--json")
    assert result.returncode == 1
    assert json.loads(result.stdout)[0]["problems"][0]["code"] == "run-mismatch"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["ls", "/no/such/store"], "no checkpoint store"),
        (["verify", "/no/such/store"], "no checkpoint store"),
        (["inspect", "{store}", "--step", "999"], "no generation of step 999"),
        (["verify", "{store}", "--step", "10", "--all"], "mutually exclusive"),
    ],
)
def test_errors_are_one_line_without_traceback(store: Path, populated, args, fragment):
    result = run_cli(*(a.format(store=store) for a in args), process=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0]


def test_empty_store_verify_fails_cleanly(tmp_path: Path):
    result = run_cli("verify", str(tmp_path))
    assert result.returncode == 2 and "holds no generations" in result.stderr


def test_verify_shows_progress_for_large_generations(store: Path):
    with cv.CheckpointManager(store, run_id="big") as mgr:
        mgr.save(1, {"big": torch.zeros(20 * 1024 * 1024)})  # 80 MiB
    # As if stderr were an interactive terminal: the bar is drawn there, never on stdout.
    terminal = {"TTY_COMPATIBLE": "1", "TTY_INTERACTIVE": "1", "COLUMNS": "100"}
    result = run_cli("verify", str(store), env=terminal)
    assert result.returncode == 0 and "verifying step 1" not in result.stdout
    assert "verifying step 1" in result.stderr
    # With --json (a program reads the output) or piped to a file, there is no bar at all.
    result = run_cli("verify", str(store), "--json", env=terminal)
    assert result.returncode == 0 and result.stderr == ""
    json.loads(result.stdout)
    assert run_cli("verify", str(store)).stderr == ""


@pytest.mark.parametrize(
    "args",
    [
        ["verify", "{store}", "--step", "abc"],
        ["no-such-command"],
        ["verify"],
        ["ls", "{store}", "--bogus"],
    ],
)
def test_usage_errors_are_one_line(store: Path, populated, args):
    result = run_cli(*(a.format(store=store) for a in args), process=True)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
