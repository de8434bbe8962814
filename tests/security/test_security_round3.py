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
import time
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import UsageError
from ckptvault.events import Deleted, Published, Validated
from ckptvault.format.layout import GenerationName, generation_dirname, new_generation_id
from ckptvault.observe.catalog import Catalog, validated_generations
from ckptvault.ops.signing.sign import sign_generations
from ckptvault.storage import open_store
from ckptvault.storage.records import DELETION_MARK
from ckptvault.trust.signing import generate_keypair
from support.common import run_cli


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


# -- the newest validated generation is known by its name ----------------------------------


def test_a_planted_copy_of_a_validated_id_takes_no_protection_in_either_tier(tmp_path):
    """One policy over two tiers. Step 2 was validated (the catalog says so) and is
    older than keep_last keeps, so only "newest validated" keeps it. Someone who can
    write the local tier alone plants a directory under step 3 with step 2's id. Before
    the fix the planted name took that protection, and the genuine step 2 was deleted
    from the local tier and from the replica the attacker cannot write."""
    local, replica, catalog = tmp_path / "local", tmp_path / "replica", tmp_path / "catalog.db"
    save_steps(local, "r", range(1, 7), replicate_to=replica, catalog=catalog)
    validated = next(name for name in names(local) if name[0] == 2)
    with Catalog(catalog) as book:
        assert book.mark_validated(validated[1], time.time())
    planted = local / generation_dirname(3, validated[1])
    planted.mkdir()
    (planted / "manifest.json").write_text("{}")
    retention = cv.Retention(keep_last=2, delete_delay=0)
    save_steps(local, "r", (7,), replicate_to=replica, catalog=catalog, retention=retention)
    assert validated in names(local) and validated in names(replica)
    assert validated_generations(catalog, "r") == {GenerationName(*validated)}


def test_the_catalog_keeps_its_record_when_a_planted_name_with_its_id_is_deleted(tmp_path):
    """Retention deletes the planted directory (step 3, a genuine id): the catalog's
    record of the genuine generation (step 2), its tiers and its validation stay."""
    path, gid = tmp_path / "catalog.db", new_generation_id()
    with Catalog(path) as book:
        book.record(Published("r", "/s", 2, gid, f"/s/{generation_dirname(2, gid)}", 10, 0.1))
        book.record(Validated("r", "/s", 2, gid, ok=True, seconds=0.1))
        book.record(Deleted("r", "/s", 3, gid, "no retention rule keeps it"))
        assert [g.step for g in book.generations("/s")] == [2]
    assert validated_generations(path, "r") == {GenerationName(2, gid)}
    with Catalog(path) as book:  # the genuine generation's own deletion still ends it
        book.record(Deleted("r", "/s", 2, gid, "no retention rule keeps it"))
        assert book.generations("/s") == []
    assert validated_generations(path, "r") == frozenset()


# -- signing vouches only for what restore would take ------------------------------------


@pytest.fixture
def encrypted_with_plant(tmp_path, keypair) -> tuple[Path, Path, Path]:
    """An encrypted run (steps 1, 2) and, planted at step 9, a plaintext generation
    that names the run: anyone can write one, with every digest right."""
    store, keys, plain = tmp_path / "store", tmp_path / "keys", tmp_path / "plain"
    save_steps(store, "r", (1, 2), keystore=keys, ledger=tmp_path / "a" / "ledger.db")
    save_steps(plain, "r", (9,))
    copy_generations(plain, store)
    return store, keys, tmp_path / "a" / "ledger.db"


def test_sign_with_the_key_store_never_signs_a_plaintext_generation_of_an_encrypted_run(
    encrypted_with_plant, keypair
):
    """Before the fix step 9 was signed: a verifier or an export that trusts the key
    (without the key store) then took the attacker's weights as the operator's."""
    store, keys, ledger = encrypted_with_plant
    private, public = keypair
    report = sign_generations(store, private, every=True, keystore=keys, ledger=ledger)
    outcomes = {g.step: (g.outcome, g.detail) for g in report.generations}
    assert outcomes[1][0] == outcomes[2][0] == "signed"
    assert outcomes[9][0] == "failed" and "not-encrypted" in outcomes[9][1]
    assert not report.ok
    planted = next(p for p in store.iterdir() if p.name.startswith("step-000000000009."))
    assert not (planted / "manifest.sig").exists()
    result = run_cli("verify", str(store), "--step", "9", "--trusted-key", str(public))
    assert result.returncode == 1  # signature-missing: nothing vouches for it


def test_sign_without_the_key_store_refuses_a_run_that_has_encrypted_generations(
    encrypted_with_plant, keypair
):
    """Only step 9 chosen: nothing encrypted among the targets, but the run is encrypted,
    so only its key store can tell the plaintext generation for the plant it is."""
    store, _keys, ledger = encrypted_with_plant
    private, _public = keypair
    with pytest.raises(UsageError, match="keystore=") as refused:
        sign_generations(store, private, step=9, ledger=ledger)
    assert "Nothing was signed" in str(refused.value)
    assert not any((p / "manifest.sig").exists() for p in store.iterdir() if p.is_dir())


# -- a deletion mark counts only where restore counts it, in every tier that holds it ----

OLD = "1970-01-01T00:00:00.000000Z"
MILESTONES = cv.Retention(keep_every=100, delete_delay=86400)  # a day's grace


def plant_marks(store: Path, steps: set[int], marked_at: str = OLD) -> None:
    opened = open_store(store)
    for ref in opened.list_generations():
        if ref.step in steps:
            record = {"marked_at": marked_at, "reason": "no retention rule keeps it"}
            opened.put_record(DELETION_MARK, ref.name.dirname, record)


def present(store: Path) -> set[int]:
    return {step for step, _ in names(store)}


def test_marks_planted_in_the_local_tier_delete_nothing_in_the_replica(tmp_path):
    """One policy over two tiers. Old-dated marks planted in the local tier on steps 104
    and 105 made the next pass delete both from the replica at once: 105 (the fallback,
    kept otherwise) and 104 (marked now, otherwise, with a day's grace)."""
    local, replica = tmp_path / "local", tmp_path / "replica"
    options = {"replicate_to": replica, "retention": MILESTONES}
    save_steps(local, "r", range(100, 106), **options)
    plant_marks(local, {104, 105})
    save_steps(local, "r", (106,), **options)
    assert {104, 105, 106} <= present(replica) and {104, 105, 106} <= present(local)


def test_a_mark_both_tiers_carry_is_dated_by_the_later_one(tmp_path):
    """Retention marked 101-103 in both tiers a moment ago; rewriting the local tier's
    marks to 1970 must not end their day of grace in the replica."""
    local, replica = tmp_path / "local", tmp_path / "replica"
    options = {"replicate_to": replica, "retention": MILESTONES}
    save_steps(local, "r", range(100, 106), **options)
    marked = set(open_store(replica).list_records(DELETION_MARK))
    assert {n.split(".")[0] for n in marked} >= {"step-000000000101", "step-000000000103"}
    plant_marks(local, {101, 102, 103})
    save_steps(local, "r", (106,), **options)
    assert {101, 102, 103} <= present(replica)


def test_with_a_ledger_retention_ignores_the_marks_restore_ignores(tmp_path):
    """One tier, with a ledger: restore ignores a mark the ledger has no record of
    (it would otherwise roll the run back), and so must retention: before the fix the
    planted old marks got 104 and 105 (the fallback) deleted at once."""
    store, ledger = tmp_path / "store", tmp_path / "ctl" / "ledger.db"
    save_steps(store, "r", range(100, 106), retention=MILESTONES, ledger=ledger)
    plant_marks(store, {104, 105})
    save_steps(store, "r", (106,), retention=MILESTONES, ledger=ledger)
    assert {104, 105, 106} <= present(store)
    with cv.CheckpointManager(store, run_id="r", ledger=ledger) as mgr:
        info = mgr.restore({"w": torch.zeros(4)})
    assert info is not None and info.step == 106
    # ckptvault's own marks still count: 104 is marked again (now, recorded), and the
    # ledger records it; the pass after its delay deletes it.
    marks = open_store(store).list_records(DELETION_MARK)
    mark_104 = next(data for name, data in marks.items() if name.startswith("step-000000000104."))
    assert mark_104["marked_at"] != OLD


# -- a pin keeps the step, whatever else was put under it ------------------------------


def test_a_directory_planted_under_a_pinned_step_does_not_take_the_pin(tmp_path):
    """``mgr.pin(1)`` pinned "the newest generation of step 1": a directory planted in
    the local tier under step 1 with a later id took the pin, and the genuine step 1
    was deleted from both tiers by the next pass."""
    local, replica = tmp_path / "local", tmp_path / "replica"
    save_steps(local, "r", (1, 2, 3), replicate_to=replica)
    genuine = next(name for name in names(local) if name[0] == 1)
    planted = local / generation_dirname(1, new_generation_id())
    planted.mkdir()
    (planted / "manifest.json").write_text("{}")
    retention = cv.Retention(keep_last=1, delete_delay=0)
    with cv.CheckpointManager(local, run_id="r", replicate_to=replica, retention=retention) as mgr:
        mgr.pin(1)
        mgr.save(4, weights(4))
    assert genuine in names(local) and genuine in names(replica)
    result = run_cli("gc", str(local), "--unpin", "1")
    assert result.returncode == 0, result.stderr
    assert open_store(local).list_records("pinned") == {}  # every pin of the step goes


# -- status reads the records of what it lists, no more ----------------------------------


def test_status_reads_no_planted_replica_record(tmp_path, monkeypatch):
    """``ckptvault status`` (and a Prometheus scrape of it) read every replica record in
    the store, whatever its name: thousands planted cost a read each, every scrape."""
    from ckptvault.observe.health import check_health
    from ckptvault.storage.posix import records as posix_records

    local, replica = tmp_path / "local", tmp_path / "replica"
    save_steps(local, "r", (1, 2), replicate_to=replica)
    planted = local / ".records" / "replica"
    for index in range(500):
        (planted / f"x{index:04d}.json").write_text('{"tiers": []}')
    reads: list[str] = []
    original = posix_records.read_small_file

    def counting(dir_fd: int, name: str, limit: int) -> bytes:
        reads.append(name)
        return original(dir_fd, name, limit)

    monkeypatch.setattr(posix_records, "read_small_file", counting)
    report = check_health(open_store(local), None)
    assert report.replication_lag_s == 0.0  # the genuine records still count
    assert len(reads) <= 2 and not any(name.startswith("x") for name in reads)


# -- export: a plaintext plant in an encrypted run names no run ---------------------------


def test_export_does_not_count_a_planted_plaintext_generation_as_a_run(encrypted_with_plant):
    """Without --run-id, export learns the run from the step's generations: a plaintext
    generation of another run planted at the step of an encrypted run made it refuse
    (two runs). Restore refuses the plant, so it names no run."""
    from ckptvault.ops.export import export_weights
    from ckptvault.trust.keystore import LocalKeyStore

    store, keys, _ledger = encrypted_with_plant
    save_steps(store.parent / "other", "x", (2,))
    copy_generations(store.parent / "other", store)
    out = store.parent / "w.safetensors"
    result = export_weights(store, 2, out, key="w", keystore=LocalKeyStore(keys))
    assert (result.run_id, result.step) == ("r", 2) and out.is_file()
