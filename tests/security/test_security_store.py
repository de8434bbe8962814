"""Attacks through the store's own control entries and files (someone who can write
the store, but not the ledger, the key store or the trainer). Each test performs the
attack with real files and asserts the secure outcome."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import RollbackError
from ckptvault.trust import checks
from ckptvault.trust.audit_verify import verify_audit_log
from ckptvault.trust.ledger import Ledger
from support.common import make_training_state, only_tensor_file, train_steps


@pytest.fixture
def control_plane(tmp_path: Path) -> dict[str, Path]:
    """Ledger and audit log in their own directory, outside the store."""
    directory = tmp_path / "control"
    return {
        "dir": directory,
        "ledger": directory / "ledger.sqlite3",
        "audit": directory / "audit.jsonl",
    }


def manager(store: Path, plane: dict[str, Path], **kwargs) -> cv.CheckpointManager:
    return cv.CheckpointManager(
        store, run_id="r", ledger=plane["ledger"], audit_log=plane["audit"], **kwargs
    )


def snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` (the progress files sit in a folder there)."""
    files = (p for p in sorted(directory.rglob("*")) if p.is_file())
    return {str(p.relative_to(directory)): p.read_bytes() for p in files}


def test_a_staging_symlink_cannot_make_a_save_delete_the_ledger(store: Path, control_plane):
    state = make_training_state()
    with manager(store, control_plane) as mgr:
        mgr.save(100, state)
        mgr.save(200, state)
        assert mgr.restore(make_training_state()).step == 200  # floor 200
    before = snapshot(control_plane["dir"])
    # The attack: .staging points at the control-plane directory.
    os.rmdir(store / ".staging")
    (store / ".staging").symlink_to(control_plane["dir"], target_is_directory=True)
    with manager(store, control_plane) as mgr:
        mgr.save(300, state)  # cleans staging leftovers: must not follow the link
    after = snapshot(control_plane["dir"])
    assert set(after) == set(before)  # nothing deleted there
    assert not (store / ".staging").is_symlink() and (store / ".staging").is_dir()
    assert Ledger(control_plane["ledger"]).floor("r").step == 200
    assert verify_audit_log(control_plane["audit"], Ledger(control_plane["ledger"])).ok
    # And the floor still holds: an older step is refused.
    with manager(store, control_plane) as mgr, pytest.raises(RollbackError):
        mgr.restore(make_training_state(), step=100)


def test_a_lock_symlink_cannot_make_a_save_overwrite_a_key(store: Path, tmp_path: Path):
    keys = tmp_path / "keys"
    state = make_training_state()
    with cv.CheckpointManager(
        store, run_id="r", keystore=keys, audit_log=tmp_path / "a.jsonl"
    ) as mgr:
        mgr.save(1, state)
    kek_file = next(keys.glob("*.kek"))
    kek_bytes = kek_file.read_bytes()
    # The attack: the lock file is a symlink to the run's key (names are predictable).
    (store / ".writer.lock").unlink()
    (store / ".writer.lock").symlink_to(kek_file)
    with cv.CheckpointManager(
        store, run_id="r", keystore=keys, audit_log=tmp_path / "a.jsonl"
    ) as mgr:
        train_steps(state, 1)
        mgr.save(2, state)
        assert not (store / ".writer.lock").is_symlink()
        assert kek_file.read_bytes() == kek_bytes  # not truncated, not overwritten
        assert mgr.restore(make_training_state()).step == 2  # the key still opens the run


def test_a_hard_linked_lock_file_is_replaced_not_truncated(store: Path, tmp_path: Path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"x": torch.ones(2)})
    (store / ".writer.lock").unlink()
    os.link(victim, store / ".writer.lock")
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(2, {"x": torch.ones(2)})
    assert victim.read_text() == "keep me"
    assert os.stat(store / ".writer.lock").st_ino != os.stat(victim).st_ino


def test_a_symlinked_generation_or_staging_entry_is_never_followed(store: Path, tmp_path: Path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep")
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"x": torch.ones(2)})
    # A leftover "staging area" that is a symlink to a directory outside the store.
    (store / ".staging" / "20260101T000000000000Z-deadbeef").symlink_to(outside)
    # A "generation" that is a symlink to a copy of a real one outside the store.
    real = next(store.glob("step-*"))
    (store / real.name.replace("step-000000000001", "step-000000000009")).symlink_to(real)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore({"x": torch.zeros(2)})
        assert info.step == 1 and "unsafe-entry" in info.skipped[0].reason
        mgr.save(2, {"x": torch.ones(2)})  # removes the staging link, not what it points at
    assert (outside / "keep.txt").read_text() == "keep"
    assert os.listdir(store / ".staging") == []


@pytest.mark.timeout(60)
def test_a_fifo_swapped_in_after_the_checks_does_not_hang_restore(
    store: Path, monkeypatch: pytest.MonkeyPatch
):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"x": torch.ones(2)})
        second = mgr.save(2, {"x": torch.full((2,), 2.0)}).result()
    target = only_tensor_file(Path(second.path))
    real_check = checks.check_structure

    def check_then_swap(store_, ref, policy=None, indexes=None):
        checked = real_check(store_, ref, policy, indexes)
        if ref.step == 2:  # the race: swap the checked file for a FIFO before it is read
            target.chmod(0o644)
            target.unlink()
            os.mkfifo(target)
        return checked

    monkeypatch.setattr("ckptvault.io.load.check_structure", check_then_swap)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        restored = {"x": torch.zeros(2)}
        info = mgr.restore(restored)
    assert info.step == 1 and "unsafe-entry" in info.skipped[0].reason
    assert torch.equal(restored["x"], torch.ones(2))


def test_a_planted_non_canonical_generation_name_is_not_listed(store: Path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.save(5, {"x": torch.ones(2)}).result()
    real = Path(info.path)
    # "step-0000000000005" is step 5 spelled differently: not one of ours.
    os.rename(real, store / real.name.replace("step-000000000005", "step-0000000000005"))
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert mgr.generations() == []
        assert mgr.restore({"x": torch.zeros(2)}) is None
