"""Command-line habits: tables that survive a pipe, ``export`` that picks the newest
valid step itself, ``inspect --json`` that names everything whole, errors that name
the flags a user typed, and a contract mismatch that says what changed."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.cli import main
from ckptvault.cli._wording import FLAGS, cli_wording
from ckptvault.errors import ContractMismatch
from ckptvault.state.contract import build_contract, compare_contracts
from ckptvault.trust.signing import generate_keypair
from support.common import only_tensor_file, run_cli, writable

LONG = "a_rather_long_parameter_name_" * 6  # 174 characters: past any terminal width


class Named(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer(LONG, torch.arange(3.0))
        self.head = torch.nn.Linear(3, 2)


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def deep_store(tmp_path: Path) -> Path:
    """Three generations in a store whose path alone is wider than 80 columns."""
    store = tmp_path / ("nested-directory-" * 4) / "store"
    with cv.CheckpointManager(store, run_id="r") as mgr:
        for step in (1, 2, 3):
            torch.manual_seed(step)
            mgr.save(step, {"model": Named(), "meta": {LONG: step}})
    return store


def test_ls_piped_is_a_plain_table_one_line_per_generation(deep_store: Path):
    """Through a real pipe (stdout is not a terminal), whatever COLUMNS says."""
    result = run_cli("ls", str(deep_store), env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split() == ["step", "generation", "id", "created", "size", "path"]
    assert len(rows) == 3
    listed = json.loads(run_cli("ls", str(deep_store), "--json").stdout)
    for row, info in zip(rows, listed, strict=True):
        assert row.split()[0] == str(info["step"]) and row.endswith(info["path"])
        assert row == row.rstrip() and len(row) > 80  # whole, not wrapped or cut
        # Columns line up under the header.
        assert row.index(info["generation_id"]) == header.index("generation id")


def test_export_without_step_takes_the_newest_step_that_verifies(deep_store, tmp_path, capsys):
    out = tmp_path / "w.safetensors"
    code, text, err = run(capsys, "export", deep_store, "--out", out, "--json")
    assert code == 0 and json.loads(text)["step"] == 3, err
    newest = next(deep_store.glob("step-000000000003.*"))
    data = writable(only_tensor_file(newest))
    data.write_bytes(data.read_bytes()[:-1] + b"\x00")  # damaged: the export falls back
    code, text, err = run(capsys, "export", deep_store, "--out", out, "--json")
    assert code == 0 and json.loads(text)["step"] == 2, err


def test_inspect_names_everything_whole(deep_store, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "40")
    code, text, _ = run(capsys, "inspect", deep_store, "--json")
    report = json.loads(text)
    assert code == 0 and f"model/{LONG}" in [t["key"] for t in report["tensors"]]
    assert LONG in report["state"]["meta"]
    # The human tables, piped, do not cut names either.
    code, text, _ = run(capsys, "inspect", deep_store)
    assert code == 0 and f"model/{LONG}" in text and "…" not in text
    blake3 = next(iter(report["files"].values()))["blake3"]
    assert re.search(rf"\b{blake3}$", text, re.M)


@pytest.mark.parametrize(
    ("args", "flags"),
    [
        (["gc", "{store}", "--keep-best", "2"], ["--keep-best", "--metric"]),
        (["gc", "{store}", "--metric", "loss"], ["--metric", "--keep-best"]),
        (["export", "{store}", "--out", "{tmp}/w", "--dtype", "f8"], ["--dtype"]),
        (["export", "{store}", "--out", "{tmp}/w", "--signing-key", "{tmp}/k"], ["--trusted-key"]),
        (["export", "{encrypted}", "--out", "{tmp}/w"], ["--keystore"]),
        (["ls", "s3://bucket/prefix", "--s3-endpoint-url", "nope"], ["--s3-endpoint-url"]),
        (["sign", "{store}", "--signing-key", "{tmp}/k", "--step", "1", "--all"], ["--all"]),
    ],
    ids=["keep-best", "metric", "dtype", "signing-key", "keystore", "s3-endpoint-url", "sign"],
)
def test_errors_name_the_flags_not_python_arguments(capsys, tmp_path, args, flags):
    store, encrypted = tmp_path / "store", tmp_path / "encrypted"
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"model": torch.nn.Linear(2, 2)})
    with cv.CheckpointManager(encrypted, run_id="r", keystore=tmp_path / "keys") as mgr:
        mgr.save(1, {"model": torch.nn.Linear(2, 2)})
    generate_keypair(tmp_path / "k", tmp_path / "k.pub")
    values = {"store": store, "encrypted": encrypted, "tmp": tmp_path}
    code, _, err = run(capsys, *(a.format(**values) for a in args))
    assert code == 2 and err.startswith("ckptvault: error: ") and len(err.splitlines()) == 1
    # No argument a command takes as a flag is named as Python spells it (keystore=).
    assert not re.search(rf"\b({'|'.join(FLAGS)})=", err), err
    assert "Retention(" not in err
    for flag in flags:
        assert flag in err, (flag, err)


def test_the_wording_keeps_values_and_drops_the_call():
    assert cli_wording("Retention(keep_last=3) or metric=NAME, then pass keystore= now") == (
        "--keep-last 3 or --metric NAME, then pass --keystore now"
    )
    assert cli_wording("pass signing_key= (--signing-key) with it") == "pass --signing-key with it"
    assert cli_wording("allow_contract_change=True, myrun_id=2 and catalog=False stay") == (
        "allow_contract_change=True, myrun_id=2 and catalog=False stay"
    )


def test_contract_mismatch_names_the_changed_sub_fields(store: Path):
    saved = {"config": {"lr": 3e-4, "betas": (0.9, 0.95), "layers": 12}, "dataset": "ds-v3"}
    with cv.CheckpointManager(store, run_id="r", contract=saved) as mgr:
        mgr.save(1, {"model": torch.nn.Linear(2, 2)})
    now = {"config": {"lr": 1e-4, "betas": (0.9, 0.99), "layers": 12, "warmup": 100}}
    with (
        cv.CheckpointManager(store, run_id="r", contract=now) as mgr,
        pytest.raises(ContractMismatch) as raised,
    ):
        mgr.restore({"model": torch.nn.Linear(2, 2)})
    message = str(raised.value)
    for change in (
        "config.lr: 3e-4 → 1e-4",
        "config.betas[1]: 0.95 → 0.99",
        "config.warmup: absent → 100",
        "dataset: 'ds-v3' → absent",
    ):
        assert change in message, (change, message)
    assert "layers" not in message and raised.value.fields == ["config", "dataset"]


def test_contract_mismatch_stays_bounded_and_whole_where_it_cannot_look_inside():
    big = {"blob": "x" * 5000}  # kept as a digest
    stored = build_contract({"big": big, "many": {f"k{i}": i for i in range(1, 50)}}, None)
    changed = {"big": {"blob": "y" * 5000}, "many": {f"k{i}": -i for i in range(1, 50)}}
    with pytest.raises(ContractMismatch) as raised:
        compare_contracts(stored, changed, "generation g")
    message = str(raised.value)
    assert "big: changed (too large to compare field by field" in message
    assert "(50 changes in all)" in message and message.count("→") == 19
    long_value = build_contract({"name": "n" * 500}, None)
    with pytest.raises(ContractMismatch, match=r"name: 'nnn.*\.\.\. → 'other'") as raised:
        compare_contracts(long_value, {"name": "other"}, "generation g")
    assert len(str(raised.value)) < 400
