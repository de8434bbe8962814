"""Issue 23, item 5: one more round against retention, gc, signing and the run's memory.

Each test performs an attack by someone who can write the store (or one tier of it)
and checks that no genuine, published generation is lost and that nothing restore
would refuse is vouched for:

- ``ckptvault gc`` without ``--run-id`` took the run from whatever verified; genuine
  generations of another run signed with the same key, copied into the store at
  higher steps, took every rule's place and the run's own generations were deleted;
- the newest validated generation was known by its id alone: a directory planted in
  the local tier under another step with that id took its protection, and the
  genuine validated generation was deleted from both tiers;
- ``ckptvault sign`` with the run's key store signed a plaintext generation planted
  in an encrypted run, so the operator's key vouched for bytes restore refuses.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.storage import open_store
from ckptvault.storage.records import DELETION_MARK
from ckptvault.trust.signing import generate_keypair
from conftest import run_cli


def weights(step: int) -> dict:
    return {"w": torch.full((4,), float(step))}


def names(store: Path) -> list[tuple[int, str]]:
    return sorted((ref.step, ref.generation_id) for ref in open_store(store).list_generations())


def save_steps(store: Path, run_id: str, steps: range | tuple[int, ...], **options: object) -> None:
    with cv.CheckpointManager(store, run_id=run_id, **options) as mgr:  # type: ignore[arg-type]
        for step in steps:
            mgr.save(step, weights(step))


def copy_generations(source: Path, target: Path) -> None:
    """What someone who can write ``target`` can do: copy whole generations in."""
    for path in source.iterdir():
        if path.name.startswith("step-"):
            shutil.copytree(path, target / path.name)


@pytest.fixture
def keypair(tmp_path: Path) -> tuple[Path, Path]:
    private, public = tmp_path / "k.pem", tmp_path / "k.pub"
    generate_keypair(private, public)
    return private, public


# -- gc decides for one run --------------------------------------------------------------


def test_gc_without_run_id_refuses_genuine_generations_of_another_run(tmp_path, keypair):
    """Two runs signed with one key (one team's key); the other run's generations are
    copied into this run's store at higher steps. Before the fix gc took the run from
    the newest generation that verified (the other run's) and deleted steps 1-3."""
    private, public = keypair
    store, other = tmp_path / "store", tmp_path / "other"
    save_steps(store, "r", (1, 2, 3), signing_key=private, ledger=tmp_path / "a" / "ledger.db")
    save_steps(other, "other", (10, 11), signing_key=private, ledger=tmp_path / "b" / "ledger.db")
    ours = names(store)
    copy_generations(other, store)
    gc = ("gc", str(store), "--keep-last", "1", "--delete-delay", "0s")
    result = run_cli(*gc, "--trusted-key", str(public), "--json")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--run-id" in result.stderr and "'other'" in result.stderr and "'r'" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert set(ours) <= set(names(store))  # nothing of the run was deleted...
    assert open_store(store).list_records(DELETION_MARK) == {}  # ...or marked
    # Told whose generations to decide about, gc keeps the run's newest (the other
    # run's copies take no rule's place).
    result = run_cli(*gc, "--trusted-key", str(public), "--run-id", "r", "--json")
    assert result.returncode == 0, result.stderr
    assert max(ours) in names(store)
    kept = {d["step"] for d in json.loads(result.stdout)["decisions"] if d["action"] == "keep"}
    assert 3 in kept


def test_gc_without_run_id_still_runs_on_a_store_of_one_run(tmp_path, keypair):
    private, public = keypair
    store = tmp_path / "store"
    save_steps(store, "r", (1, 2, 3), signing_key=private, ledger=tmp_path / "a" / "ledger.db")
    result = run_cli(
        "gc", str(store), "--keep-last", "1", "--delete-delay", "0s", "--trusted-key", str(public)
    )
    assert result.returncode == 0, result.stderr
    assert [step for step, _ in names(store)] == [2, 3]  # the newest, and its fallback


def test_gc_run_inference_ignores_what_fails_the_checks(tmp_path, keypair):
    """An unsigned copy of another run in a signed store passes no check: it names no
    run, and gc goes on for the one run that verifies."""
    private, public = keypair
    store, other = tmp_path / "store", tmp_path / "other"
    save_steps(store, "r", (1, 2, 3), signing_key=private, ledger=tmp_path / "a" / "ledger.db")
    save_steps(other, "other", (10,))
    copy_generations(other, store)
    result = run_cli(
        "gc", str(store), "--keep-last", "1", "--delete-delay", "0s", "--trusted-key", str(public)
    )
    assert result.returncode == 0, result.stderr
    assert {step for step, _ in names(store)} >= {2, 3}
