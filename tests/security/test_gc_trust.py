"""``ckptvault gc`` and ``verify`` take the trust options restore takes (issue 23).

gc decides which generations take a rule's place, so it must trust exactly what
restore trusts: on an encrypted store it needs the key store (the manifest MAC is
what tells a genuine generation from a copy anyone could re-digest), on a signed one
the trusted keys. Without them it refuses in one line naming the option, and marks
nothing. With them a forgery takes no slot. ``verify --keystore`` checks the MAC too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.format.layout import generation_dirname, new_generation_id, parse_generation_dirname
from ckptvault.storage import open_store
from ckptvault.storage.records import DELETION_MARK
from ckptvault.trust.signing import generate_keypair
from support.common import run_cli
from support.forging import read_logical, write_logical


def weights(step: int) -> dict:
    return {"w": torch.full((8,), float(step))}


def save(store: Path, losses: dict[int, float], **trust: object) -> None:
    with cv.CheckpointManager(store, run_id="r", **trust) as mgr:  # type: ignore[arg-type]
        for step, loss in losses.items():
            mgr.save(step, weights(step), metrics={"val_loss": loss})


def forge_copy(store: Path, step: int, **fields: object) -> Path:
    """A copy of the generation of ``step`` under a new id with ``fields`` changed and
    every digest recomputed (no key needed); an encrypted one keeps its stale MAC."""
    genuine = next(p for p in store.iterdir() if _step(p) == step)
    document = read_logical(genuine)
    document["generation_id"] = new_generation_id()
    document.update(fields)
    planted = store / generation_dirname(document["step"], document["generation_id"])
    shutil.copytree(genuine, planted)
    planted.chmod(0o755)
    write_logical(planted, document)
    return planted


def _step(path: Path) -> int | None:
    name = parse_generation_dirname(path.name)
    return name.step if name is not None else None


def listing(store: Path) -> list[str]:
    return sorted(ref.name.dirname for ref in open_store(store).list_generations())


def no_marks(store: Path) -> bool:
    return open_store(store).list_records(DELETION_MARK) == {}


GC_BEST = ["--keep-last", "1", "--keep-best", "1", "--metric", "val_loss", "--delete-delay", "0s"]


@pytest.fixture
def encrypted(tmp_path: Path) -> tuple[Path, Path]:
    store, keys = tmp_path / "store", tmp_path / "keys"
    save(store, {1: 0.1, 2: 0.5, 3: 0.6, 4: 0.7}, keystore=keys)
    return store, keys


def test_gc_refuses_an_encrypted_store_without_the_keystore(encrypted, tmp_path: Path):
    store, _keys = encrypted
    before = listing(store)
    result = run_cli("gc", str(store), *GC_BEST, "--ledger", str(tmp_path / "ledger.db"))
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--keystore" in result.stderr and "is encrypted" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert listing(store) == before and no_marks(store)  # nothing marked, nothing deleted


def test_gc_with_the_keystore_counts_no_forgery(encrypted, tmp_path: Path):
    """The issue's attack through the CLI: a copy of step 2 claims val_loss=-1. Its MAC
    does not check, so step 1 keeps keep_best's place and survives."""
    store, keys = encrypted
    planted = forge_copy(store, 2, metrics={"val_loss": -1.0})
    result = run_cli("gc", str(store), *GC_BEST, "--keystore", str(keys), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    kept = {d["step"]: d for d in report["decisions"] if d["action"] == "keep"}
    assert 1 in kept and any("keep_best" in r for r in kept[1]["reasons"])
    assert any(s == 1 for s in (_step(p) for p in store.iterdir()))
    forged = next(d for d in report["decisions"] if d["generation_id"] in planted.name)
    assert not any("keep_best" in r for r in forged["reasons"])


def test_gc_refuses_a_signed_store_without_trusted_keys(tmp_path: Path):
    store, private, public = tmp_path / "store", tmp_path / "k.pem", tmp_path / "k.pub"
    generate_keypair(private, public)
    save(store, {1: 0.1, 2: 0.5, 3: 0.6}, signing_key=private)
    before = listing(store)
    result = run_cli("gc", str(store), *GC_BEST)
    assert result.returncode == 2 and "--trusted-key" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert listing(store) == before and no_marks(store)
    result = run_cli("gc", str(store), *GC_BEST, "--trusted-key", str(public), "--json")
    assert result.returncode == 0, result.stderr
    assert sorted(_step(p) for p in store.iterdir() if _step(p) is not None) == [1, 2, 3]


def test_gc_on_an_unsigned_plaintext_store_needs_no_keys(tmp_path: Path):
    store = tmp_path / "store"
    save(store, {1: 0.1, 2: 0.5, 3: 0.6})
    result = run_cli("gc", str(store), *GC_BEST)
    assert result.returncode == 0, result.stderr
    assert sorted(_step(p) for p in store.iterdir() if _step(p) is not None) == [1, 2, 3]


def test_verify_with_the_keystore_checks_the_mac(encrypted):
    store, keys = encrypted
    planted = forge_copy(store, 2, metrics={"val_loss": -1.0})
    # Without the key: integrity only (the forgery's digests agree), and a note says so.
    result = run_cli("verify", str(store), "--all", "--json")
    assert result.returncode == 0, result.stdout
    assert all(r["notes"] for r in json.loads(result.stdout))
    # With it: the forgery fails, as restore would refuse it; the genuine ones pass.
    result = run_cli("verify", str(store), "--all", "--json", "--keystore", str(keys))
    assert result.returncode == 1
    reports = {r["generation_id"]: r for r in json.loads(result.stdout)}
    forged = next(r for gid, r in reports.items() if gid in planted.name)
    assert {p["code"] for p in forged["problems"]} == {"key-unavailable"}
    genuine = [r for r in reports.values() if r is not forged]
    assert len(genuine) == 4 and all(r["ok"] and not r["notes"] for r in genuine)


def test_verify_with_the_ledger_fails_what_a_rollback_abandoned(tmp_path: Path):
    store, ledger = tmp_path / "store", tmp_path / "ledger.db"
    save(store, {1: 0.1, 2: 0.2, 3: 0.3}, ledger=ledger)
    with cv.CheckpointManager(store, run_id="r", ledger=ledger) as mgr:
        assert mgr.restore(weights(0), allow_rollback_to=1) is not None
    result = run_cli(
        "verify", str(store), "--all", "--json", "--run-id", "r", "--ledger", str(ledger)
    )
    assert result.returncode == 1
    verdicts = {r["step"]: {p["code"] for p in r["problems"]} for r in json.loads(result.stdout)}
    assert verdicts == {3: {"rollback"}, 2: {"rollback"}, 1: set()}
    without = run_cli("verify", str(store), "--all", "--ledger", str(ledger))
    assert without.returncode == 2 and "--run-id" in without.stderr
