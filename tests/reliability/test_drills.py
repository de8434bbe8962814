"""Recovery drills: ``ckptvault drill`` runs every scenario and each passes (or says
why it cannot run here); drilling a real store never changes it."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from support.common import run_cli

TIMING_KEYS = ("discovery_s", "verification_s", "read_s", "apply_s", "recovery_s")


@pytest.mark.heavy
def test_synthetic_drills_all_pass_or_say_why_not() -> None:
    result = run_cli("drill", "--synthetic", "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    drills = json.loads(result.stdout)
    assert [d["name"] for d in drills] == list(cv_drill_names())
    for drill in drills:
        assert drill["expected"] and drill["observed"]
        if drill["passed"] is None:
            assert drill["skipped"], drill
        else:
            assert drill["passed"] is True, drill
        for key, value in drill.items():
            if key.endswith("_s"):
                assert isinstance(value, float) and value >= 0, (key, value)
    by_name = {d["name"]: d for d in drills}
    for name in ("truncated-file", "flipped-byte", "missing-file", "remote-tier-only"):
        assert all(key in by_name[name] for key in TIMING_KEYS), by_name[name]
    supervised = by_name["supervised-restart"]
    for key in ("detection_s", "launch_s", "restore_s", "first_step_s", "recovery_s"):
        assert key in supervised, supervised
    hang = by_name["hang-watchdog"]  # killed by the hang watchdog, resumed from its save
    assert "ended as hang" in hang["observed"], hang
    for key in ("detection_s", "restore_s", "recovery_s"):
        assert key in hang, hang


def cv_drill_names() -> tuple[str, ...]:
    from ckptvault.ops.drills import DRILL_NAMES

    return DRILL_NAMES


def _fingerprint(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every entry under ``root``: content digest (files), mode and mtime."""
    seen = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        seen[str(path.relative_to(root))] = (digest, info.st_mode, info.st_mtime_ns)
    return seen


def test_drilling_a_store_leaves_it_byte_for_byte_unchanged(tmp_path: Path) -> None:
    store = tmp_path / "live"
    model = torch.nn.Linear(32, 16)
    state = {"model": model, "meta": {"step": 0}}
    with cv.CheckpointManager(store, run_id="live-run") as manager:
        for step in (1, 2, 3):
            with torch.no_grad():
                model.weight.add_(1.0)
            manager.save(step, state)
    before = _fingerprint(store)
    only = "truncated-file,flipped-byte,missing-file,extra-pickle,other-run,format-version"
    only += ",rollback,key-destroyed,remote-tier-only,storage-full,sigkill-mid-save"
    result = run_cli("drill", str(store), "--json", "--only", only, timeout=300)
    assert _fingerprint(store) == before
    assert result.returncode == 0, result.stdout + result.stderr
    drills = {d["name"]: d for d in json.loads(result.stdout)}
    assert set(drills) == set(only.split(","))
    assert drills["key-destroyed"]["passed"] is None
    assert "not encrypted" in drills["key-destroyed"]["skipped"]
    for name, drill in drills.items():
        assert drill["passed"] is not False, drill
        if name != "key-destroyed" and drill["passed"] is None:
            assert drill["skipped"], drill


@pytest.mark.heavy
def test_the_report_table_and_exit_status(tmp_path: Path) -> None:
    wide = {"COLUMNS": "250"}
    result = run_cli("drill", "--synthetic", "--only", "missing-file,rollback", env=wide)
    assert result.returncode == 0, result.stderr
    assert "missing-file" in result.stdout and "pass" in result.stdout
    assert "2 passed, 0 failed" in " ".join(result.stdout.split())
    unknown = run_cli("drill", "--synthetic", "--only", "nonsense")
    assert unknown.returncode == 2 and "unknown drill" in unknown.stderr
    both = run_cli("drill", str(tmp_path), "--synthetic")
    assert both.returncode == 2


def test_an_encrypted_store_needs_its_key_store_and_drills_a_copy(tmp_path: Path) -> None:
    store, keys = tmp_path / "live", tmp_path / "keys"
    state = {"w": torch.ones(64), "meta": {"step": 0}}
    with cv.CheckpointManager(
        store, run_id="enc", keystore=keys, ledger=tmp_path / "l.db"
    ) as manager:
        manager.save(1, state)
        manager.save(2, state)
    keys_before = _fingerprint(keys)
    missing = run_cli("drill", str(store), "--only", "key-destroyed")
    assert missing.returncode == 2 and "--keystore" in missing.stderr
    result = run_cli(
        "drill",
        str(store),
        "--keystore",
        str(keys),
        "--json",
        "--only",
        "key-destroyed,flipped-byte",
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert all(d["passed"] is True for d in json.loads(result.stdout))
    assert _fingerprint(keys) == keys_before  # the copy was erased, not the live key
    assert os.listdir(keys)
