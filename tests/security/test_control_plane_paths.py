"""Control-plane state goes where the README says: the audit log beside the ledger
(the one ``ledger=`` names, else the default one), nothing written by an export
without trust options, and ``ckptvault audit verify`` finding the log and its ledger
from each other."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.cli import main
from ckptvault.ops.export import consolidate_weights, export_weights
from ckptvault.trust.signing import generate_keypair

CONTROL_FILES = ("ledger.sqlite3", "audit.jsonl")


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def save(store: Path, steps=(1, 2), **options) -> None:
    with cv.CheckpointManager(store, run_id="r", **options) as mgr:
        for step in steps:
            torch.manual_seed(step)
            mgr.save(step, {"model": torch.nn.Linear(4, 3)})


def control_files(directory: Path) -> list[str]:
    return sorted(name for name in CONTROL_FILES if (directory / name).exists())


def test_the_audit_log_goes_beside_the_ledger_given(store, tmp_path, isolated_state_dir, capsys):
    """ledger= elsewhere: the log is written beside it, the per-user state directory
    gets neither file, and `audit verify` finds each from the other."""
    secure = tmp_path / "secure"
    ledger = secure / "ledger.sqlite3"
    save(store, ledger=ledger)
    with cv.CheckpointManager(store, run_id="r", ledger=ledger) as mgr:
        assert mgr.restore({"model": torch.nn.Linear(4, 3)}).step == 2
    events = [
        json.loads(line)["event"] for line in (secure / "audit.jsonl").read_text().splitlines()
    ]
    assert events == ["save", "save", "restore"]
    assert control_files(isolated_state_dir) == []

    code, out, err = run(capsys, "audit", "verify", "--ledger", ledger, "--json")  # no LOG
    report = json.loads(out)
    assert code == 0 and report["ok"] and report["head_checked"], err
    assert Path(report["path"]) == (secure / "audit.jsonl").resolve() and report["entries"] == 3
    code, out, _ = run(capsys, "audit", "verify", secure / "audit.jsonl", "--json")  # no --ledger
    report = json.loads(out)
    assert code == 0 and report["head_checked"] and Path(report["ledger"]) == ledger
    # Cut off the last entry: found through the ledger beside the log, with no flag.
    log = secure / "audit.jsonl"
    log.write_text("".join(log.read_text().splitlines(keepends=True)[:-1]))
    code, out, _ = run(capsys, "audit", "verify", log)
    assert code == 1 and "cut off" in out


def test_audit_verify_without_arguments_checks_the_default_log(store, isolated_state_dir, capsys):
    save(store, ledger=isolated_state_dir / "ledger.sqlite3")
    code, out, _ = run(capsys, "audit", "verify")
    assert code == 0 and str(isolated_state_dir / "audit.jsonl") in out and "2 entries" in out


def test_gc_with_a_ledger_records_beside_it(store, tmp_path, isolated_state_dir, capsys):
    save(store, steps=(1, 2, 3))
    ledger = tmp_path / "secure" / "ledger.sqlite3"
    code, _, err = run(
        capsys, "gc", store, "--keep-last", "1", "--delete-delay", "0s", "--ledger", ledger
    )
    assert code == 0, err
    events = [
        json.loads(line)["event"]
        for line in (ledger.parent / "audit.jsonl").read_text().splitlines()
    ]
    assert "delete" in events
    assert control_files(isolated_state_dir) == []


def test_export_without_trust_options_writes_no_ledger_or_audit(
    store, tmp_path, isolated_state_dir, capsys
):
    save(store)
    assert control_files(isolated_state_dir) == []  # an unsigned run wrote none either
    code, out, err = run(capsys, "export", store, "--step", 1, "--out", tmp_path / "a.st", "--json")
    assert code == 0 and json.loads(out)["step"] == 1, err
    export_weights(store, 2, tmp_path / "b.safetensors")
    consolidate_weights(store, tmp_path / "hf")
    assert control_files(isolated_state_dir) == []
    assert sorted(p.name for p in tmp_path.iterdir() if p.name in CONTROL_FILES) == []


def test_export_with_trust_options_is_recorded_beside_its_ledger(
    store, tmp_path, isolated_state_dir
):
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    save(store, signing_key=tmp_path / "k.pem", ledger=tmp_path / "other" / "ledger.sqlite3")
    ledger = tmp_path / "secure" / "ledger.sqlite3"
    export_weights(
        store, 2, tmp_path / "m.safetensors", trusted_keys=[tmp_path / "k.pub"], ledger=ledger
    )
    entries = [
        json.loads(line) for line in (ledger.parent / "audit.jsonl").read_text().splitlines()
    ]
    assert [e["event"] for e in entries] == ["export"] and entries[0]["step"] == 2
    # Trusted keys alone: the default ledger, and the log beside it.
    export_weights(store, None, tmp_path / "n.safetensors", trusted_keys=[tmp_path / "k.pub"])
    assert control_files(isolated_state_dir) == sorted(CONTROL_FILES)
