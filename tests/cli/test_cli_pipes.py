"""Every table a command prints survives a pipe: piped (stdout not a terminal) it is
plain text, one line per row, never folded or cut at 80 columns whatever
``COLUMNS`` says, so ``grep`` and ``awk`` see every name whole. Each command runs
in a real process whose stdout is a pipe (``python -m ckptvault ... | cat``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptvault as cv

RUN = "a-run-whose-name-is-longer-than-any-terminal-is-wide-" * 2  # 106 characters


@pytest.fixture(scope="module")
def deep(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An encrypted run with a long name, in a store whose path is past 80 columns,
    with its ledger (and the catalog beside it) and key store."""
    root = tmp_path_factory.mktemp("pipes")
    places = {
        "store": root / ("nested-directory-" * 4) / "store",
        "ledger": root / "control" / "ledger",
        "keystore": root / "keys",
    }
    with cv.CheckpointManager(
        places["store"], run_id=RUN, ledger=places["ledger"], keystore=places["keystore"]
    ) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"model": torch.nn.Linear(2, 2)})
    return places


def piped(*args: object) -> tuple[int, list[str]]:
    """``python -m ckptvault ARGS | cat`` with COLUMNS=80: its status and stdout lines."""
    command = " ".join(f"'{a}'" for a in (sys.executable, "-m", "ckptvault", *args))
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", f"{command} | cat"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "80"},
    )
    return result.returncode, result.stdout.splitlines()


def assert_whole(lines: list[str], *values: str) -> None:
    """Each value is on one line, whole; nothing was folded or cut (no ellipsis)."""
    for value in values:
        assert any(value in line for line in lines), (value, lines)
    assert not any("…" in line for line in lines)
    assert any(len(line) > 80 for line in lines)


def row_under(lines: list[str], header: list[str]) -> int:
    """The index of the header line whose words are ``header``."""
    return next(i for i, line in enumerate(lines) if line.split() == header)


def test_catalog_piped(deep):
    code, lines = piped("catalog", "--ledger", deep["ledger"])
    assert code == 0, lines
    start = row_under(
        lines,
        ["UTC", "run", "step", "size", "total", "s", "stall", "s"]
        + [word for stage in ("stage", "write", "fsync", "publish") for word in (stage, "s")]
        + ["outcome"],
    )
    assert lines[start - 1] == "saves"
    rows = lines[start + 1 : start + 4]
    assert [row.split()[3] for row in rows] == ["3", "2", "1"]  # one line per save
    assert all(RUN in row and row.endswith("ok") for row in rows)
    assert_whole(lines, RUN)


def test_keys_list_piped(deep):
    code, lines = piped("keys", "list", "--keystore", deep["keystore"])
    assert code == 0, lines
    header, row = lines
    assert header.split() == ["run", "key", "id", "created", "destroyed"]
    assert row.startswith(RUN + "  ") and row.endswith("-")
    assert_whole(lines, RUN)


def test_doctor_piped(deep):
    code, lines = piped(
        "doctor", deep["store"], "--ledger", deep["ledger"], "--keystore", deep["keystore"]
    )
    assert code in (0, 1), lines  # the findings are not what this test is about
    assert lines[0].split()[:3] == ["check", "status", "detail"]
    permissions = next(line for line in lines if line.startswith("store permissions "))
    assert str(deep["store"]) in permissions  # the path whole, on the finding's one line
    assert_whole(lines, str(deep["store"]))


def test_drill_piped(deep):
    code, lines = piped(
        "drill", deep["store"], "--keystore", deep["keystore"], "--only", "missing-file"
    )
    assert code == 0, lines
    title, header, row, summary = lines
    assert title == f"Recovery drills on a copy of {deep['store']}"
    assert header.split()[:2] == ["drill", "result"]
    assert row.split()[:2] == ["missing-file", "pass"] and row.endswith(")")
    assert "(expected: " in row and summary == "1 passed, 0 failed"
    assert_whole(lines, str(deep["store"]))
