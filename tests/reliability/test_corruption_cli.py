"""Corruption as a user meets it: ``ckptvault verify --all`` on stores whose
generations each had a byte flipped (see ``test_corruption.py`` for the sweep)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

import ckptvault as cv
from ckptvault.trust.signing import generate_keypair
from support.common import run_cli
from support.corruption_sweep import RUN, small_state, tensor_file_regions, train, whole_file
from support.reliability import record

pytestmark = pytest.mark.reliability


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    generate_keypair(tmp_path / "trainer.pem", tmp_path / "trainer.pub")
    return {"private": tmp_path / "trainer.pem", "public": tmp_path / "trainer.pub"}


# -- the command line -----------------------------------------------------------------


def _flip(path: Path, offset: int, pattern: int = 0x01) -> None:
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[offset] ^= pattern
    path.write_bytes(bytes(data))


def _save_steps(store: Path, steps: int, **options: object) -> dict[int, Path]:
    state, paths = small_state(seed=0), {}
    with cv.CheckpointManager(store, run_id=RUN, **options) as mgr:
        for step in range(1, steps + 1):
            train(state, 1)
            paths[step] = Path(mgr.save(step, state).result().path)
    return paths


def test_cli_verify_reports_flipped_bytes(tmp_path: Path, keys: dict[str, Path]) -> None:
    """``ckptvault verify --all`` as a user runs it: one store with a flipped
    manifest, tensor header, tensor data and index byte; one signed and encrypted store with
    a flipped signature, container and manifest byte. Each generation fails with its
    code, the pristine one passes, the exit status is 1."""
    rng = random.Random(0)
    plain = _save_steps(tmp_path / "plain", 5)
    header = tensor_file_regions(sorted(plain[3].glob("*.safetensors"))[0])[0]
    data = tensor_file_regions(sorted(plain[4].glob("*.safetensors"))[0])[1]
    _flip(plain[2] / "manifest.json", rng.randrange(whole_file(plain[2] / "manifest.json").end))
    _flip(plain[3] / header.file, rng.randrange(header.start, header.end))
    _flip(plain[4] / data.file, data.end - 1, 0x80)
    index = sorted(plain[5].glob("*-index.json"))[0]
    _flip(index, rng.randrange(whole_file(index).end))
    sealed = _save_steps(
        tmp_path / "sealed", 4, signing_key=keys["private"], keystore=tmp_path / "keys"
    )
    _flip(sealed[2] / "manifest.sig", 40, 0xFF)
    _flip(sorted(sealed[3].glob("*.safetensors.enc"))[0], 100)
    _flip(sealed[4] / "manifest.json", 7, 0x80)
    expected = {1: set(), 2: {"manifest-invalid", "manifest-corrupt", "format-unsupported"}}
    expected[3] = {"digest-mismatch"}
    expected[4] = {"digest-mismatch"}
    expected[5] = {"digest-mismatch"}
    sealed_expected = {1: set(), 2: {"signature-invalid", "signature-untrusted"}}
    sealed_expected |= {3: {"digest-mismatch"}, 4: {"signature-invalid"}}
    failures = []
    for store, wanted, extra in (
        (tmp_path / "plain", expected, []),
        (tmp_path / "sealed", sealed_expected, ["--trusted-key", str(keys["public"])]),
    ):
        result = run_cli("verify", str(store), "--all", "--json", *extra)
        reports = {r["step"]: r for r in json.loads(result.stdout)}
        if result.returncode != 1:
            failures.append(f"{store.name}: exit {result.returncode}, {result.stderr}")
        for step, codes in wanted.items():
            found = {p["code"] for p in reports[step]["problems"]}
            if (not codes and found) or (codes and not found & codes):
                failures.append(f"{store.name} step {step}: expected {codes or 'OK'}, got {found}")
    record("corruption: ckptvault verify (CLI)", 7, len(failures), "fixed flips, seed 0")
    assert not failures, failures
