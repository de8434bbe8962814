"""Retention defaults for users coming from Hugging Face and Orbax (issue 28, item 5):
``keep_last`` alone gives space back at the next save; ``status`` shows the space
marked generations still hold; ``gc`` applies the manager's recorded policy besides
its own rules (a forged record can only make it keep more), and replaces it only
with ``--replace-policy``, after showing what it would delete."""

from __future__ import annotations

import json
from pathlib import Path

import torch

import ckptvault as cv
from ckptvault.cli._common import human_bytes
from ckptvault.retention.recorded import RETENTION_RECORD, read_policy, record_name
from ckptvault.storage import open_store
from support.common import run_cli

LOSSES = {1: 0.9, 2: 0.1, 3: 0.5, 4: 0.6, 5: 0.7, 6: 0.8}  # step 2 is the best


def steps(store: Path, *extra: str) -> list[int]:
    return [g["step"] for g in json.loads(run_cli("ls", str(store), "--json", *extra).stdout)]


def save(store: Path, retention: cv.Retention, metrics: bool = False) -> None:
    with cv.CheckpointManager(store, run_id="r", retention=retention, catalog=False) as mgr:
        for step, loss in LOSSES.items():
            mgr.save(
                step,
                {"w": torch.full((4,), float(step))},
                metrics={"loss": loss} if metrics else None,
            )


def test_keep_last_alone_gives_space_back_at_the_next_save(tmp_path: Path):
    store = tmp_path / "store"
    save(store, cv.Retention(keep_last=2))
    assert steps(store, "--all") == [6, 5]  # deleted, not marked: like save_total_limit


def test_status_shows_the_space_marked_generations_hold(tmp_path: Path):
    store = tmp_path / "store"
    save(store, cv.Retention(keep_last=2, keep_every=100))  # another rule: a day's delay
    assert steps(store) == [6, 5] and steps(store, "--all") == [6, 5, 4, 3, 2, 1]
    listed = json.loads(run_cli("ls", str(store), "--json", "--all").stdout)
    held = sum(g["bytes"] for g in listed if "marked" in g)
    report = json.loads(run_cli("status", str(store), "--json").stdout)
    assert report["storage"]["marked"] == {"generations": 4, "bytes": held}
    text = run_cli("status", str(store)).stdout
    assert f"marked for deletion  {human_bytes(held)} in 4 generation(s)" in text


def test_gc_keeps_the_managers_keep_best_winner(tmp_path: Path):
    store = tmp_path / "store"
    policy = cv.Retention(keep_last=3, keep_best=1, metric="loss", delete_delay=0)
    save(store, policy, metrics=True)
    assert steps(store) == [6, 5, 4, 2]  # the best, step 2, is kept by the manager
    assert read_policy(open_store(store), "r") == policy
    result = run_cli("gc", str(store), "--keep-last", "3", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert "recorded policy: keep_last=3, keep_best=1" in report["policy"]
    assert steps(store, "--all") == [6, 5, 4, 2]  # nothing marked: the winner stays
    alone = run_cli("gc", str(store), "--json")  # no rule given: the recorded policy
    assert alone.returncode == 0 and "recorded policy" in json.loads(alone.stdout)["policy"]
    said = json.loads(alone.stdout)["policy"]  # the pass's own delay, labelled as such
    assert "; applied: the recorded policy, delete_delay=0s" in said
    assert steps(store, "--all") == [6, 5, 4, 2]


def test_a_forged_record_only_ever_keeps_more(tmp_path: Path):
    """Whoever can write the store writes a policy that keeps one and deletes at once;
    gc --keep-last 3 still keeps three. A garbled record, or one for another run, is
    ignored with a warning."""
    store = tmp_path / "store"
    save(store, cv.Retention(keep_last=6, delete_delay=0))
    opened = open_store(store)
    forged = {"keep_last": 1, "delete_delay": 0}
    document = {"version": 1, "run_id": "r", "policy": forged, "recorded_at": "x"}
    opened.put_record(RETENTION_RECORD, record_name("r"), document)
    result = run_cli("gc", str(store), "--keep-last", "3", "--delete-delay", "0s")
    assert result.returncode == 0, result.stderr
    assert steps(store, "--all") == [6, 5, 4]  # the user's three, not the forged one
    for bad in (
        {**document, "policy": {"keep_last": True}},
        {**document, "policy": {"keep_last": 1, "rm": "-rf"}},
        {**document, "run_id": "other"},
        {**document, "policy": {"keep_within": 10**400}},  # no float holds it
    ):
        opened.put_record(RETENTION_RECORD, record_name("r"), bad)
        result = run_cli("gc", str(store), "--keep-last", "2", "--delete-delay", "0s", "--dry-run")
        assert result.returncode == 0 and "is ignored" in result.stderr, (bad, result.stderr)


def test_replace_policy_shows_what_it_would_delete_then_needs_yes(tmp_path: Path):
    store = tmp_path / "store"
    save(store, cv.Retention(keep_last=3, keep_best=1, metric="loss", delete_delay=0), metrics=True)
    args = ["gc", str(store), "--keep-last", "2", "--delete-delay", "0s", "--replace-policy"]
    asked = run_cli(*args)  # stdin is not a terminal: no one to ask
    assert asked.returncode == 2 and "Pass --yes to confirm" in asked.stderr
    assert "dry run" in asked.stdout and "delete" in asked.stdout  # the preview
    assert steps(store) == [6, 5, 4, 2]  # nothing changed
    done = run_cli(*args, "--yes")
    assert done.returncode == 0, done.stderr
    assert steps(store, "--all") == [6, 5]
    assert read_policy(open_store(store), "r") == cv.Retention(keep_last=2, delete_delay=0)
