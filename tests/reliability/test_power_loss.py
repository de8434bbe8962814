"""Simulated power loss: at every point of a save, in the worst ways a disk may lose
what was not yet durable, a restarted run restores the previous generation or the
new one, bit for bit, and never a broken one.

Each scenario records one save's file-system operations (``power_loss``), builds
every crash state of it (``power_loss_states``: every point, each in several
variants of lost, undone and torn writes) and restores from each with a fresh
manager (``power_loss_check``). Trials are the distinct crash states restored;
failures the states where restore did the wrong thing. The long budget
(``make reliability``) adds more variants per point and two scenarios: a larger save,
and an asynchronous signed, encrypted save whose retention marks a generation.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import ckptvault as cv
from ckptvault.trust.signing import generate_keypair
from support.power_loss import AddName, RemoveName, Write
from support.power_loss_check import RUN_ID, Recorded, Scenario, explore, record_save
from support.power_loss_states import CI_VARIANTS, LONG_VARIANTS
from support.reliability import long_run, record

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
    """Where the save is recorded and crash states are built: memory when the machine
    has it. Each restore commits to the ledger and the audit log, and fsync on a busy
    disk would cost more than everything else; the recording sees every call and the
    model decides what a power cut keeps, whatever the filesystem underneath."""
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


def added(recorded: Recorded) -> list[str]:
    """Every name the recorded save created or renamed into place."""
    return [op.name for op in recorded.recorder.log if isinstance(op, AddName)]


def removed(recorded: Recorded) -> list[str]:
    return [op.name for op in recorded.recorder.log if isinstance(op, RemoveName)]


def test_plain_save(scratch: Path):
    scenario = Scenario("power loss: plain save, POSIX", base_options, history=1)
    recorded = run_scenario(scenario, scratch)
    assert [name for name in added(recorded) if name.startswith("step-")] == [
        f"step-000000000002.{recorded.new[0]}"
    ]


def test_signed_save(tmp_path: Path, scratch: Path):
    private, public = tmp_path / "signer.pem", tmp_path / "signer.pub"
    generate_keypair(private, public)

    def options(world: Path, ledger: Path) -> dict:
        return {**with_ledger(world, ledger), "signing_key": private, "trusted_keys": [public]}

    scenario = Scenario("power loss: signed save, POSIX", options, history=1, trusted=public)
    recorded = run_scenario(scenario, scratch)
    assert "manifest.sig" in added(recorded)


def test_encrypted_save(scratch: Path):
    def options(world: Path, ledger: Path) -> dict:
        return {**with_ledger(world, ledger), "keystore": world / "keys"}

    scenario = Scenario("power loss: encrypted save, POSIX", options, history=1)
    recorded = run_scenario(scenario, scratch)
    assert any(name.endswith(".enc") for name in added(recorded)), added(recorded)


def test_first_encrypted_save_into_a_new_key_store(scratch: Path):
    """The run's key is made during the save: it must be as durable as the generation
    it unlocks (it was not: test_power_loss_regressions)."""

    def options(world: Path, ledger: Path) -> dict:
        return {**with_ledger(world, ledger), "keystore": world / "keys" / "run-keys"}

    name = "power loss: first encrypted save, new key store, POSIX"
    recorded = run_scenario(Scenario(name, options, history=0), scratch)
    assert any(name.endswith(".kek") for name in added(recorded)), added(recorded)


def test_save_with_retention_deletion(scratch: Path):
    """keep_last=1 with a fallback: saving step 3 deletes step 1 (marked, renamed out
    of the listing, removed, unmarked, forgotten by the ledger) within save()."""

    def options(world: Path, ledger: Path) -> dict:
        keep = cv.Retention(keep_last=1, delete_delay=0)
        return {**with_ledger(world, ledger), "retention": keep}

    scenario = Scenario("power loss: save with retention deletion, POSIX", options, history=2)
    recorded = run_scenario(scenario, scratch)
    assert any(name.startswith("step-000000000001.") for name in removed(recorded))


def test_async_signed_encrypted_save_that_marks_a_generation(tmp_path: Path, scratch: Path):
    """Long budget only: everything at once, in the background, and a retention that
    marks a generation for later deletion (its first mark: ``.records/deleted`` is made
    during the save)."""
    if not long_run():
        pytest.skip("long budget only (make reliability)")
    private, public = tmp_path / "signer.pem", tmp_path / "signer.pub"
    generate_keypair(private, public)

    def options(world: Path, ledger: Path) -> dict:
        keep = cv.Retention(keep_last=1, delete_delay=3600)
        trust = {"signing_key": private, "trusted_keys": [public], "keystore": world / "keys"}
        return {**with_ledger(world, ledger), **trust, "retention": keep, "async_save": True}

    name = "power loss: async signed encrypted save marking a generation, POSIX"
    recorded = run_scenario(Scenario(name, options, history=2, trusted=public), scratch)
    assert "deleted" in added(recorded), added(recorded)


def test_larger_save_with_write_behind(scratch: Path):
    """Long budget only: a save of about 10 MB, past the first 8 MiB write-behind
    (sync_file_range) of its tensor file, with the ledger on."""
    if not long_run():
        pytest.skip("long budget only (make reliability)")
    scenario = Scenario(
        "power loss: 10 MB save with write-behind, POSIX", with_ledger, history=1, width=1 << 16
    )
    recorded = run_scenario(scenario, scratch)
    written: dict[int, int] = {}
    for op in recorded.recorder.log:
        if isinstance(op, Write):
            written[op.inode] = written.get(op.inode, 0) + len(op.data)
    assert max(written.values()) > 8 << 20  # past the first write-behind
