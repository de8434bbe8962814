"""Simulated power loss: at every point of a save, in the worst ways a disk may lose
what was not yet durable, a restarted run restores the previous generation or the
new one, bit for bit, and never a broken one.

Each scenario records one save's file-system operations (``power_loss``), builds
every crash state of it (``power_loss_states``: every point, each in several
variants of lost, undone and torn writes) and restores from each with a fresh
manager (``power_loss_check``). Trials are the distinct crash states restored;
failures the states where restore did the wrong thing. The long budget
(``make reliability``) adds more variants per point.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import ckptvault as cv
from ckptvault.trust.signing import generate_keypair
from power_loss import AddName, RemoveName
from power_loss_check import RUN_ID, Recorded, Scenario, explore, record_save
from power_loss_states import CI_VARIANTS, LONG_VARIANTS
from reliability import long_run, record

pytestmark = pytest.mark.reliability


def variants() -> tuple[str, ...]:
    return CI_VARIANTS + LONG_VARIANTS if long_run() else CI_VARIANTS


def base_options(world: Path, ledger: Path) -> dict:
    """What every scenario's manager gets: small, quiet, no catalog (SQLite outside the
    modelled world, and nothing restore reads)."""
    return {"run_id": RUN_ID, "catalog": False, "metrics": False, "threads": 2}


def with_ledger(world: Path, ledger: Path) -> dict:
    audit = world / "audit" / "audit.jsonl"
    return {**base_options(world, ledger), "ledger": ledger, "audit_log": audit}


@pytest.fixture
def scratch(tmp_path: Path) -> Iterator[Path]:
    """Where crash states are built: memory when the machine has it. Each restore
    commits to the ledger and the audit log, and fsync on a busy disk would cost more
    than everything else; how these copies reach the disk is no part of the test."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path / "power-loss"
        return
    with tempfile.TemporaryDirectory(dir=shm, prefix="ckptvault-power-loss-") as directory:
        yield Path(directory)


def run_scenario(scenario: Scenario, scratch: Path) -> Recorded:
    recorded = record_save(scenario, scratch)
    found = explore(recorded, variants(), scratch)
    detail = (
        f"{found.points} points x variants {'+'.join(variants())} = {found.states} crash "
        f"states, {found.trials} distinct; ops {len(recorded.recorder.log)}"
    )
    record(scenario.name, found.trials, len(found.failures), detail)
    print(f"{scenario.name}: {detail}")
    assert not found.failures, "\n".join(list(found.failures.values())[:10])
    return recorded


def renamed_into_root(recorded: Recorded) -> list[str]:
    """Names the save renamed into the store's root directory (publishes)."""
    return [op.name for op in recorded.recorder.log if isinstance(op, AddName) and op.rename is not None and op.name.startswith("step-")]


def test_plain_save(tmp_path: Path, scratch: Path):
    scenario = Scenario("power loss: plain save, POSIX", base_options, history=1)
    recorded = run_scenario(scenario, scratch)
    assert len(renamed_into_root(recorded)) == 1


def test_signed_save(tmp_path: Path, scratch: Path):
    generate_keypair(tmp_path / "signer.pem", tmp_path / "signer.pub")

    def options(world: Path, ledger: Path) -> dict:
        signing = {"signing_key": tmp_path / "signer.pem", "trusted_keys": [tmp_path / "signer.pub"]}
        return {**with_ledger(world, ledger), **signing}

    scenario = Scenario(
        "power loss: signed save, POSIX", options, history=1, trusted=tmp_path / "signer.pub"
    )
    recorded = run_scenario(scenario, scratch)
    created = [op.name for op in recorded.recorder.log if isinstance(op, AddName)]
    assert "manifest.sig" in created


def test_encrypted_save(tmp_path: Path, scratch: Path):
    def options(world: Path, ledger: Path) -> dict:
        return {**with_ledger(world, ledger), "keystore": world / "keys"}

    scenario = Scenario("power loss: encrypted save, POSIX", options, history=1)
    recorded = run_scenario(scenario, scratch)
    created = [op.name for op in recorded.recorder.log if isinstance(op, AddName)]
    assert any(name.endswith(".enc") for name in created), created


def test_first_encrypted_save_into_a_new_key_store(tmp_path: Path, scratch: Path):
    """The run's key is made during the save: it must be durable before the
    generation it unlocks is."""

    def options(world: Path, ledger: Path) -> dict:
        return {**with_ledger(world, ledger), "keystore": world / "keys" / "run-keys"}

    scenario = Scenario("power loss: first encrypted save, new key store, POSIX", options, history=0)
    run_scenario(scenario, scratch)


def test_save_with_retention_deletion(tmp_path: Path, scratch: Path):
    def options(world: Path, ledger: Path) -> dict:
        keep = cv.Retention(keep_last=1, delete_delay=0)
        return {**with_ledger(world, ledger), "retention": keep}

    scenario = Scenario("power loss: save with retention deletion, POSIX", options, history=2)
    recorded = run_scenario(scenario, scratch)
    removed = [op.name for op in recorded.recorder.log if isinstance(op, RemoveName)]
    assert any(name.startswith("step-000000000001.") for name in removed), removed
