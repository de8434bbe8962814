"""Retention and garbage collection end to end: the manager, real stores, the CLI."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.cli.gc import parse_duration
from ckptvault.errors import NoValidCheckpoint, UsageError
from ckptvault.storage import open_store
from ckptvault.storage.leases import reading_lease
from ckptvault.storage.records import DELETION_MARK, LEASE, PIN
from support.common import only_tensor_file, run_cli, writable


def state(value: float) -> dict:
    return {"x": torch.full((4,), float(value))}


def ls(store: Path, *extra: str) -> list[dict]:
    result = run_cli("ls", str(store), "--json", *extra)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def steps(store: Path, *extra: str) -> list[int]:
    return [g["step"] for g in ls(store, *extra)]


def audit_entries(log: Path, event: str) -> list[dict]:
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    return [e for e in entries if e["event"] == event]


def tree(root: Path) -> dict[str, tuple[int, bytes | None]]:
    """Every entry below ``root`` with its mtime and (for files) bytes."""
    found = {}
    for path in sorted(root.rglob("*")):
        info = path.lstat()
        content = path.read_bytes() if path.is_file() else None
        found[str(path.relative_to(root))] = (info.st_mtime_ns, content)
    return found


def save_steps(store: Path, *steps_: int, **options) -> None:
    with cv.CheckpointManager(store, run_id="run", **options) as mgr:
        for step in steps_:
            mgr.save(step, state(step))


# -- the manager's retention -------------------------------------------------------------


def test_manager_keeps_the_last_two_and_audits_each_mark_and_delete(store: Path, tmp_path: Path):
    log = tmp_path / "audit.jsonl"
    retention = cv.Retention(keep_last=2, delete_delay=0)
    with cv.CheckpointManager(store, run_id="run", audit_log=log, retention=retention) as mgr:
        for step in range(5):
            mgr.save(step, state(step))
    assert steps(store) == [4, 3] == steps(store, "--all")
    assert sorted(p.name for p in store.iterdir() if not p.name.startswith(".")) == [
        p.name for p in sorted(store.glob("step-*"))
    ]
    deleted = audit_entries(log, "delete")
    assert [e["step"] for e in deleted] == [0, 1, 2]
    assert all(
        e["reason"] == "no retention rule keeps it" and e["run_id"] == "run" for e in deleted
    )
    assert [e["step"] for e in audit_entries(log, "mark")] == [0, 1, 2]
    assert open_store(store).list_records(DELETION_MARK) == {}  # marks removed after deletion
    verified = run_cli("audit", "verify", str(log), "--json")
    assert verified.returncode == 0, verified.stdout + verified.stderr


def test_async_saves_show_retention_in_ls_once_closed(store: Path):
    retention = cv.Retention(keep_last=1, delete_delay=0)
    with cv.CheckpointManager(store, run_id="run", async_save=True, retention=retention) as mgr:
        for step in range(4):
            mgr.save(step, state(step))
    assert steps(store) == [3, 2]  # the newest and its fallback


def test_a_marked_generation_is_hidden_unrestorable_and_can_be_undeleted(store: Path):
    retention = cv.Retention(keep_last=2, delete_delay=86400)  # marked for a day
    with cv.CheckpointManager(store, run_id="run", retention=retention) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, state(step))
        assert [g.step for g in mgr.generations()] == [30, 20]
        marked = mgr.generations(include_marked=True)[-1]
        assert marked.step == 10 and marked.marked_at and marked.mark_reason
        with pytest.raises(NoValidCheckpoint, match=r"marked for deletion.*--undelete"):
            mgr.restore(state(0), step=10)
    assert steps(store) == [30, 20]
    listed = ls(store, "--all")
    assert [g["step"] for g in listed] == [30, 20, 10]
    assert (
        "marked" not in listed[0] and listed[2]["marked"]["reason"] == "no retention rule keeps it"
    )
    assert "marked for" in run_cli("ls", str(store), "--all").stdout
    assert run_cli("verify", str(store), "--step", "10").returncode == 2

    undone = run_cli("gc", str(store), "--undelete", "10", "--json")
    assert undone.returncode == 0, undone.stderr
    assert json.loads(undone.stdout)["generations"] == [marked.generation_id]
    assert steps(store) == [30, 20, 10]
    restored = state(0)
    with cv.CheckpointManager(store, run_id="run", retention=retention) as mgr:
        assert mgr.restore(restored, step=10).step == 10
        assert torch.equal(restored["x"], torch.full((4,), 10.0))
        mgr.save(40, state(40))  # undelete pinned it: the next pass leaves it alone
    assert steps(store) == [40, 30, 10]
    assert steps(store, "--all") == [40, 30, 20, 10]


def test_pin_and_unpin_through_the_manager(store: Path):
    retention = cv.Retention(keep_last=1, delete_delay=0)
    with cv.CheckpointManager(store, run_id="run", retention=retention) as mgr:
        mgr.save(1, state(1))
        pinned = mgr.pin(1)
        assert pinned.step == 1
        for step in (2, 3, 4):
            mgr.save(step, state(step))
        assert [g.step for g in mgr.generations()] == [4, 3, 1]
        mgr.unpin(1)
        assert open_store(store).list_records(PIN) == {}
        mgr.save(5, state(5))
        assert [g.step for g in mgr.generations()] == [5, 4]
        with pytest.raises(UsageError, match="no generation of step 9"):
            mgr.pin(9)


def test_keep_best_reads_metrics_from_manifests(store: Path):
    losses = {1: 0.9, 2: 0.2, 3: 0.5, 4: 0.7, 5: 0.6}
    retention = cv.Retention(keep_last=1, keep_best=1, metric="val_loss", delete_delay=0)
    with cv.CheckpointManager(store, run_id="run", retention=retention) as mgr:
        for step, loss in losses.items():
            mgr.save(step, state(step), metrics={"val_loss": loss, "step_count": step})
        mgr.save(6, state(6))  # no metrics: never "best"
        plan = mgr.retention.last_plan
    assert steps(store) == [6, 5, 2]  # newest, fallback, best
    assert (
        "keep_best=1 (val_loss=0.2, min)" in next(d for d in plan.decisions if d.step == 2).reasons
    )
    manifest = json.loads((Path(ls(store)[1]["path"]) / "manifest.json").read_bytes())
    assert manifest["metrics"] == {"step_count": 5, "val_loss": 0.6}


@pytest.mark.parametrize(
    "metrics, fragment",
    [
        ({"val_loss": float("nan")}, "finite"),
        ({"val_loss": float("inf")}, "finite"),
        ({"ok": True}, "plain number"),
        ({"loss": "0.3"}, "plain number"),
        ({"loss": torch.tensor(0.3)}, r"\.item\(\)"),
        ({"val loss": 0.3}, "not a plain name"),
        ({"1st": 0.3}, "not a plain name"),
        ({"big": 2**70}, "out of range"),
    ],
)
def test_bad_metrics_are_refused_before_anything_is_written(store: Path, metrics, fragment):
    with cv.CheckpointManager(store, run_id="run") as mgr:
        with pytest.raises(UsageError, match=fragment):
            mgr.save(1, state(1), metrics=metrics)
        assert mgr.generations() == []
        import numpy as np

        info = mgr.save(2, state(2), metrics={"loss": np.float32(0.5), "n": np.int64(3)}).result()
        recorded = json.loads((Path(info.path) / "manifest.json").read_bytes())["metrics"]
        assert recorded == {"loss": 0.5, "n": 3}
        assert run_cli("verify", str(store)).returncode == 0  # covered by the self-digest


def test_the_restore_floor_generation_is_never_deleted(store: Path, tmp_path: Path):
    ledger = tmp_path / "ledger.sqlite3"
    save_steps(store, 1, 2, ledger=ledger)
    with cv.CheckpointManager(store, run_id="run", ledger=ledger) as mgr:
        assert mgr.restore(state(0), step=2).step == 2  # the floor is now step 2
    retention = cv.Retention(keep_last=1, delete_delay=0)
    with cv.CheckpointManager(store, run_id="run", ledger=ledger, retention=retention) as mgr:
        for step in (3, 4, 5):
            mgr.save(step, state(step))
        floor_reasons = next(d for d in mgr.retention.last_plan.decisions if d.step == 2).reasons
    assert steps(store) == [5, 4, 2]
    assert floor_reasons == ("restore floor",)


def test_a_lease_blocks_deletion_and_restore_takes_and_releases_one(store: Path, monkeypatch):
    save_steps(store, 1, 2, 3)
    backend = open_store(store)
    oldest = backend.list_generations()[-1]
    with reading_lease(backend, oldest):
        (lease_name,) = backend.list_records(LEASE)
        assert lease_name.startswith(oldest.name.dirname + ".")
        held = run_cli("gc", str(store), "--keep-last", "1", "--delete-delay", "0s", "--json")
        assert held.returncode == 0, held.stderr
        decision = next(d for d in json.loads(held.stdout)["decisions"] if d["step"] == 1)
        assert decision["action"] == "keep" and decision["reasons"][0].startswith("leased")
    assert backend.list_records(LEASE) == {}
    assert steps(store) == [3, 2, 1]
    assert run_cli("gc", str(store), "--keep-last", "1", "--delete-delay", "0s").returncode == 0
    assert steps(store) == [3, 2]

    import ckptvault.restoring.restorer as restorer

    seen: list[dict] = []
    original = restorer.load_verified

    def spying(store_, ref, *args, **kwargs):
        seen.append(store_.list_records(LEASE))
        return original(store_, ref, *args, **kwargs)

    monkeypatch.setattr(restorer, "load_verified", spying)
    writable(only_tensor_file(Path(backend.list_generations()[0].location))).write_bytes(b"\0")
    with cv.CheckpointManager(store, run_id="run") as mgr:
        assert mgr.restore(state(0)).step == 2  # step 3 is damaged: refused, lease released
    assert [len(leases) for leases in seen] == [1, 1]
    leased = [next(iter(leases)).split(".")[0] for leases in seen]
    assert leased == ["step-000000000003", "step-000000000002"]
    assert backend.list_records(LEASE) == {}


# -- ckptvault gc ------------------------------------------------------------------------------


def test_gc_dry_run_json_changes_nothing(store: Path):
    save_steps(store, 1, 2, 3, 4, retention=cv.Retention(keep_last=3, delete_delay=86400))
    staging = store / ".staging" / "20260101T000000000000Z-deadbeef"
    staging.mkdir(parents=True)
    old = time.time() - 3 * 86400
    os.utime(staging, (old, old))
    before = tree(store)
    # --replace-policy: the manager's recorded keep_last=3 would keep step 2 otherwise.
    result = run_cli(
        "gc", str(store), "--dry-run", "--json", "--keep-last", "1", "--delete-delay", "0s",
        "--replace-policy",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert tree(store) == before
    report = json.loads(result.stdout)
    assert report["dry_run"] is True and report["staging_removed"] is None
    assert [(d["step"], d["action"]) for d in report["decisions"]] == [
        (4, "keep"),
        (3, "keep"),
        (2, "delete"),
        (1, "delete"),
    ]
    assert all(d["outcome"] is None for d in report["decisions"])
    assert [v["step"] for v in report["verified"]] == [4, 3] and report["verified"][0]["ok"]
    human = run_cli("gc", str(store), "--dry-run", "--keep-last", "1", "--replace-policy")
    assert human.returncode == 0 and "dry run" in human.stdout and "fallback" in human.stdout
    assert tree(store) == before


def test_gc_applies_the_plan_and_records_it(store: Path, tmp_path: Path):
    save_steps(store, *range(0, 60, 10))
    log = tmp_path / "gc-audit.jsonl"
    result = run_cli(
        "gc",
        str(store),
        "--keep-last",
        "2",
        "--keep-every",
        "20",
        "--delete-delay",
        "1h",
        "--audit-log",
        str(log),
        "--json",
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    outcome = {d["step"]: (d["action"], d["outcome"]) for d in report["decisions"]}
    assert outcome == {
        50: ("keep", ""),
        40: ("keep", ""),
        30: ("mark", "marked"),
        20: ("keep", ""),
        10: ("mark", "marked"),
        0: ("keep", ""),
    }
    assert steps(store) == [50, 40, 20, 0]
    assert [e["step"] for e in audit_entries(log, "mark")] == [30, 10]
    # Without rules gc only finishes marks, once their delay has passed.
    again = run_cli("gc", str(store), "--delete-delay", "1h", "--json")
    assert again.returncode == 0, again.stderr
    assert {d["step"]: d["action"] for d in json.loads(again.stdout)["decisions"]}[30] == "marked"
    assert steps(store, "--all") == [50, 40, 30, 20, 10, 0]
    finish = run_cli("gc", str(store), "--delete-delay", "0s", "--audit-log", str(log))
    assert finish.returncode == 0, finish.stderr
    assert "-> deleted" in finish.stdout
    assert steps(store, "--all") == [50, 40, 20, 0]
    assert [e["step"] for e in audit_entries(log, "delete")] == [30, 10]


def test_gc_removes_only_staging_leftovers_older_than_stale_after(store: Path):
    save_steps(store, 1)
    leftovers = store / ".staging"
    old, fresh = (
        leftovers / "20260101T000000000000Z-0000000a",
        leftovers / "20260101T000000000000Z-0000000b",
    )
    for area in (old, fresh):
        area.mkdir(parents=True)
        (area / "r00000-000.safetensors").write_bytes(b"partial")
    two_days_ago = time.time() - 2 * 86400
    for path in (old / "r00000-000.safetensors", old):
        os.utime(path, (two_days_ago, two_days_ago))
    result = run_cli("gc", str(store), "--stale-after", "1d", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["staging_removed"] == [old.name]
    assert not old.exists() and fresh.exists()
    human = run_cli("gc", str(store), "--stale-after", "0s")
    assert human.returncode == 0 and f"removed 1 leftover(s) older than 0s: {fresh.name}" in (
        human.stdout
    )
    assert not fresh.exists() and steps(store) == [1]


def test_gc_refuses_while_a_trainer_holds_the_writer_lock(store: Path):
    with cv.CheckpointManager(store, run_id="run") as mgr:
        mgr.save(1, state(1))
        result = run_cli("gc", str(store), "--keep-last", "1")
        assert result.returncode == 2
        assert "StoreLocked" not in result.stderr and "trainer is idle" in result.stderr
        assert "retention=cv.Retention" in result.stderr and str(os.getpid()) in result.stderr
        assert run_cli("gc", str(store), "--keep-last", "1", "--dry-run").returncode == 0


def test_gc_deletes_nothing_when_nothing_verifies(store: Path):
    save_steps(store, 1, 2, 3)
    for generation in store.glob("step-*"):
        writable(only_tensor_file(generation)).write_bytes(b"\0")
    result = run_cli("gc", str(store), "--keep-last", "1", "--delete-delay", "0s", "--json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["newest_verified"] is None and "no generation" in report["blocked"]
    assert [v["ok"] for v in report["verified"]] == [False, False, False]
    assert steps(store) == [3, 2, 1]


def test_gc_keeps_a_damaged_newest_and_verifies_down_to_a_good_one(store: Path):
    save_steps(store, 1, 2, 3, 4)
    newest = sorted(store.glob("step-*"))[-1]
    writable(only_tensor_file(newest)).write_bytes(b"\0")
    result = run_cli("gc", str(store), "--keep-last", "1", "--delete-delay", "0s", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["newest_verified"]["step"] == 3 and report["fallback"]["step"] == 2
    assert steps(store) == [4, 3, 2]


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--stale-after", "soon"], "not a duration"),
        (["--delete-delay", "-1s"], "not a duration"),
        (["--undelete", "1", "--keep-last", "2"], "alone"),
        (["--undelete", "1", "--pin", "1"], "alone"),
        (["--keep-best", "2"], "--keep-best needs --metric"),
        (["--undelete", "7"], "no generation of step 7"),
    ],
)
def test_gc_usage_errors_are_one_line(store: Path, args, fragment):
    save_steps(store, 1)
    result = run_cli("gc", str(store), *args)
    assert result.returncode == 2 and fragment in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_gc_pin_and_unpin(store: Path):
    save_steps(store, 1, 2, 3)
    assert run_cli("gc", str(store), "--pin", "1").returncode == 0
    assert run_cli("gc", str(store), "--keep-last", "1", "--delete-delay", "0s").returncode == 0
    assert steps(store) == [3, 2, 1]
    unpinned = run_cli("gc", str(store), "--unpin", "1")
    assert unpinned.returncode == 0 and "unpinned" in unpinned.stdout
    assert run_cli("gc", str(store), "--keep-last", "1", "--delete-delay", "0s").returncode == 0
    assert steps(store) == [3, 2]


def test_parse_duration():
    assert [
        parse_duration(t, "--x") for t in ("90s", "30m", "24h", "7d", "2w", "0s", "15", "1.5h")
    ] == [
        90,
        1800,
        86400,
        7 * 86400,
        14 * 86400,
        0,
        15,
        5400,
    ]
    with pytest.raises(UsageError):
        parse_duration("1y", "--x")


def test_marks_and_deletions_reach_every_tier_and_an_unfinished_deletion_is_finished(
    tmp_path: Path,
):
    import shutil

    from ckptvault.retention.collector import GarbageCollector
    from ckptvault.trust.checks import TrustPolicy

    local, remote = tmp_path / "local", tmp_path / "remote"
    save_steps(local, 1, 2, 3, 4)
    remote.mkdir()
    for generation in local.glob("step-*"):
        shutil.copytree(generation, remote / generation.name)
    tiers = [open_store(local), open_store(remote)]
    marking = GarbageCollector(
        tiers, cv.Retention(keep_last=2).rules, 3600, policy=TrustPolicy(run_id="run")
    )
    marking.verify_newest()
    applied = marking.apply(marking.plan())
    assert [d.step for d in applied.marked] == [2, 1]
    for tier in (local, remote):
        assert steps(tier) == [4, 3] and steps(tier, "--all") == [4, 3, 2, 1]

    # Step 1 vanished from the first tier only (a deletion cut short). Each tier's mark
    # is finished in that tier alone, and only once its delay has passed, as if the
    # deletion had never been interrupted: until then both stay marked.
    step_1 = tiers[0].list_generations()[-1]
    tiers[0].delete_generation(step_1)
    finishing = GarbageCollector(tiers, (), 3600, policy=TrustPolicy(run_id="run"))
    finishing.verify_newest()
    orphans = [d for d in finishing.plan().decisions if not d.listed]
    assert [(d.step, d.action, d.only_in) for d in orphans] == [
        (1, "marked", (tiers[1].location,)),
        (1, "marked", (tiers[0].location,)),
    ]
    later = datetime.now(timezone.utc) + timedelta(seconds=3601)
    plan = finishing.plan(now=later)
    orphans = [d for d in plan.decisions if not d.listed]
    assert [(d.step, d.action, d.only_in) for d in orphans] == [
        (1, "delete", (tiers[1].location,)),
        (1, "delete", (tiers[0].location,)),
    ]
    applied = finishing.apply(plan)
    assert sorted(d.step for d in applied.deleted) == [1, 1, 2]
    for tier in (local, remote):
        assert steps(tier, "--all") == [4, 3]
        assert list(open_store(tier).list_records(DELETION_MARK)) == []


def test_a_keep_within_past_any_date_is_one_line_and_exit_2(tmp_path):
    """``--keep-within 99999999999d`` leaves datetime's range: a usage error in plain
    words (it was an internal error's OverflowError)."""
    store = tmp_path / "store"
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"w": torch.ones(2)})
    result = run_cli("gc", str(store), "--keep-within", "99999999999d", process=True)
    assert result.returncode == 2, result.stderr
    assert "thousand years" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
