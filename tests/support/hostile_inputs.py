"""What the hostile-input tests share: forging manifests, planting generations, the raw errors that must never escape."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

import ckptvault as cv
from support.common import (
    make_training_state,
    model_snapshot,
    run_cli,
    train_steps,
    writable,
)
from support.hostile_forging import writer_format

RAW_ERRORS = (
    RecursionError,
    OverflowError,
    MemoryError,
    RuntimeError,
    ValueError,
    UnicodeDecodeError,
)


def tensor_file_parts(file: Path) -> tuple[bytes, bytes]:
    """(JSON header, data region) of a tensor file."""
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return data[8 : 8 + length], data[8 + length :]


def replace_header(file: Path, header: bytes) -> None:
    """Swap a tensor file's JSON header, keeping its data region."""
    _, body = tensor_file_parts(file)
    writable(file).write_bytes(struct.pack("<Q", len(header)) + header + body)


def deep(levels: int) -> str:
    return "[" * levels + "]" * levels


def save_two_steps(
    store: Path, version: int = 3, **options: object
) -> tuple[dict[int, Path], dict[int, dict]]:
    """Steps 1 and 2 of an unsigned run written in format ``version``; the attacks
    target step 2."""
    state = make_training_state()
    paths, weights = {}, {}
    with writer_format(version), cv.CheckpointManager(store, run_id="r", **options) as mgr:
        for step in (1, 2):
            train_steps(state, 1)
            weights[step] = model_snapshot(state["model"])
            paths[step] = Path(mgr.save(step, state).result().path)
    return paths, weights


FORMATS = pytest.mark.parametrize("version", [3, 2], ids=["format-3", "format-2"])


FQN = "model/fc1.weight"  # [16, 8], one chunk


def restore_skipping(store: Path, code: str, fragment: str = "", **options) -> cv.RestoreInfo:
    """Restore must skip step 2 with ``code`` and restore step 1, raising nothing raw."""
    fresh = make_training_state(seed=9)
    try:
        with cv.CheckpointManager(store, run_id="r", **options) as mgr:
            info = mgr.restore(fresh)
    except RAW_ERRORS as exc:  # pragma: no cover - the failure this file exists for
        pytest.fail(f"restore let a raw {type(exc).__name__} escape: {exc}")
    assert info is not None and info.step == 1
    assert [(s.step, s.reason.split(":")[0]) for s in info.skipped] == [(2, code)], info.skipped
    assert fragment in info.skipped[0].reason
    return info


def assert_verify_fails(store: Path, code: str) -> None:
    """``ckptvault verify --all``: step 2 FAILs with ``code``, exit 1, no traceback;
    ``ls`` and ``inspect`` never print a traceback either."""
    result = run_cli("verify", str(store), "--all", "--json")
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    report = {r["step"]: r for r in json.loads(result.stdout)}
    assert report[1]["ok"] and not report[2]["ok"]
    assert code in {p["code"] for p in report[2]["problems"]}
    human = run_cli("verify", str(store), "--step", "2")
    assert human.returncode == 1 and "FAIL" in human.stdout and code in human.stdout
    assert human.stderr == ""
    listed = run_cli("ls", str(store), "--json")
    assert listed.returncode == 0 and "Traceback" not in listed.stderr
    inspected = run_cli("inspect", str(store), "--step", "2")
    assert inspected.returncode == 2 and "Traceback" not in inspected.stderr
    assert len(inspected.stderr.strip().splitlines()) == 1 and code in inspected.stderr


def encrypted_tensor_file(path: Path) -> Path:
    (file,) = sorted(path.glob("*.safetensors.enc"))
    return file


def nested(levels: int) -> dict:
    value: dict = {"leaf": 1}
    for _ in range(levels - 1):
        value = {"x": value}
    return value

