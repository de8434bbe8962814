"""Crash consistency: SIGKILL saves, restores, replication and gc at random moments.

Every scenario kills a real process (forked fresh from the harness's zygote,
``crash_harness``) again and again, half the time after a random delay and half the
time at a random store mutation (``crash_trials``). After each kill a fresh process
restores (the restarted trainer, or a check process) and the harness checks:

- it restored at least the last *completed* save: synchronous, ``save()`` returned
  (the generation is durable then); asynchronous, the ``SaveHandle``'s future
  resolved with the published generation (``handle.result()`` returns it), the
  README's contract; a step a restore already saw counts as completed too;
- at most the newest step a save began (one newer than the last completed is the
  kill landing after the publish, before ``save()`` returned: retention and the
  catalog run in between), restored from nothing only if nothing had completed;
- bit-exactly that step's state (``crash_state``), without skipping a damaged
  generation, and ``ckptvault verify --all`` (and ``audit verify`` when the audit
  log is on) passes on every tier.

Zero failures are allowed. CI runs the bounded budget (64 kills); ``make crash`` and
``make reliability`` the long one (``CKPTVAULT_RELIABILITY_LONG=1``). The seed is
printed and each failure names it; ``CKPTVAULT_CRASH_SEED=N`` replays a run's choices
(the timing of timer kills varies).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support.crash_harness import Tally, Zygote
from support.crash_trials import (
    RunState,
    calibrate_gc,
    calibrate_restores,
    calibrate_saves,
    check_restore,
    gc_trial,
    restore_trial,
    save_trial,
)
from support.reliability import budget, record
from support.seaweedfs_server import fresh_prefix, s3_server_of

pytestmark = pytest.mark.reliability


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    forks = Zygote(tmp_path_factory.mktemp("zygote"))
    yield forks
    forks.close()


def _tally(scenario: str) -> tuple[Tally, random.Random]:
    seed = int(os.environ.get("CKPTVAULT_CRASH_SEED", str(time.time_ns() % 2**32)))
    print(f"{scenario}: seed {seed}")
    return Tally(scenario, seed), random.Random(seed)


def _report(tally: Tally, kills: int, min_mid_operation: int) -> None:
    print(tally.detail())
    record(tally.scenario, tally.kills, len(tally.failures) + (tally.kills < kills), tally.detail())
    assert not tally.failures, "\n".join(tally.failures[:10])
    assert tally.kills == kills
    # The kills really landed inside the operation under test, not only between them.
    assert tally.mid_operation >= min_mid_operation, tally.detail()


def _job(tmp_path: Path, **options: Any) -> dict[str, Any]:
    return {"store": str(tmp_path / "store"), "workdir": str(tmp_path), "ballast_mb": 8,
            "keep_last": 3, **options}  # fmt: skip


def _save_scenario(
    zygote: Zygote,
    scenario: str,
    jobs: list[dict[str, Any]],
    kills: int,
    world: int = 1,
    pick: Callable[[int], int] = lambda trial: 0,
) -> None:
    """Kill save loops ``kills`` times; trial ``t`` runs ``jobs[pick(t)]`` (the same
    store, saved synchronously or not)."""
    tally, rng = _tally(scenario)
    run = RunState()
    calibrate_saves(zygote, jobs[0], run, world)
    for trial in range(kills):
        save_trial(zygote, jobs[pick(trial)], run, tally, trial, rng, world)
    if world == 1:  # the last kill's check (each other's came with the next trial)
        check_restore(zygote, jobs[0], tally, kills - 1, run.completed, run.newest)
    _report(tally, kills, min_mid_operation=kills // 4)


def test_sync_saves_posix(zygote: Zygote, tmp_path: Path) -> None:
    kills = budget(16, 140)
    _save_scenario(zygote, "crash: sync save, POSIX, 1 rank", [_job(tmp_path)], kills)


def test_async_saves_posix(zygote: Zygote, tmp_path: Path) -> None:
    kills = budget(10, 100)
    job = _job(tmp_path, **{"async": True})
    _save_scenario(zygote, "crash: async save, POSIX, 1 rank", [job], kills)


def test_signed_encrypted_audited_saves_posix(zygote: Zygote, tmp_path: Path) -> None:
    """Every trust feature on: manifests signed (restore requires the signature), files
    encrypted with the run's key (created by the first save), the rollback ledger and
    the hash-chained audit log (appended on every save, mark, deletion and restore)."""
    from ckptvault.trust.signing import generate_keypair

    kills = budget(6, 60)
    generate_keypair(tmp_path / "signing.pem", tmp_path / "signing.pub")
    trust = {"private": str(tmp_path / "signing.pem"), "public": str(tmp_path / "signing.pub"),
             "keystore": str(tmp_path / "keys")}  # fmt: skip
    job = _job(tmp_path, trust=trust)
    _save_scenario(zygote, "crash: sync save, signed, encrypted, audited, POSIX", [job], kills)


def test_sync_and_async_saves_s3(
    zygote: Zygote, tmp_path: Path, each_s3_bucket: str, request: pytest.FixtureRequest
) -> None:
    """Kills 0, 1 (mod 4) sync saves, 2, 3 async: a timer and a mutation kill each
    (mutations: the S3 requests that write or delete, killed before or after). On
    moto and on SeaweedFS (``each_s3_bucket``)."""
    kills = budget(4, 50)
    # No ballast: the one 6 MiB file still goes up as a multipart upload of two parts.
    store = f"s3://{each_s3_bucket}/crash"
    jobs = [_job(tmp_path, store=store, ballast_mb=0, keep_last=2, **{"async": a}) for a in (0, 1)]
    scenario = f"crash: sync and async save, S3 ({s3_server_of(request)}), 1 rank"
    _save_scenario(zygote, scenario, jobs, kills, pick=lambda trial: trial // 2 % 2)


def test_two_ranks_s3(zygote: Zygote, tmp_path: Path, seaweedfs_env: str) -> None:
    """Two ranks saving one sharded state into one S3 store, killed as in
    ``test_two_ranks_posix`` (the whole job, or one rank at a timer or at a random S3
    request that writes or deletes). On SeaweedFS only: a real server is the point,
    and the same scenario on moto would add 9 s to ``make test`` (its S3 requests and
    their kills are the one-rank scenario's, which runs on both)."""
    kills = budget(4, 32)
    store = f"{fresh_prefix(seaweedfs_env)}/crash"
    jobs = [_job(tmp_path, store=store, sharded=True, ballast_mb=0, keep_last=2,
                 **{"async": a}) for a in (0, 1)]  # fmt: skip
    scenario = "crash: sync and async save, S3 (seaweedfs), 2 ranks"
    _save_scenario(zygote, scenario, jobs, kills, world=2, pick=lambda t: (t // 4 + t) % 2)


def test_sync_and_async_saves_azure(zygote: Zygote, tmp_path: Path, azure_container: str) -> None:
    """The S3 scenario on an ``az://`` store (Azurite): kills 0, 1 (mod 4) sync saves,
    2, 3 async; a timer and a mutation kill each (mutations: the Azure requests that
    write or delete, Put Blob, Put Block, Put Block List, leases, deletes, killed
    before or after). The worker stages 1 MiB blocks, so kills land between them."""
    kills = budget(4, 50)
    store = f"az://{azure_container}/crash"
    jobs = [_job(tmp_path, store=store, ballast_mb=0, keep_last=2, **{"async": a}) for a in (0, 1)]
    scenario = "crash: sync and async save, Azure Blob (azurite), 1 rank"
    _save_scenario(zygote, scenario, jobs, kills, pick=lambda trial: trial // 2 % 2)


def test_two_ranks_posix(zygote: Zygote, tmp_path: Path) -> None:
    """Kills 0, 1 (mod 4): the whole job at one moment; 2, 3: one rank (timer, then at a
    random filesystem mutation), and the other must raise a typed error, not hang.
    Sync and async saves alternate so that over 8 kills each meets each kind."""
    kills = budget(4, 32)
    jobs = [_job(tmp_path, sharded=True, ballast_mb=4, **{"async": a}) for a in (0, 1)]
    scenario = "crash: sync and async save, POSIX, 2 ranks"
    _save_scenario(zygote, scenario, jobs, kills, world=2, pick=lambda t: (t // 4 + t) % 2)


def test_kills_during_restore(zygote: Zygote, tmp_path: Path) -> None:
    """Restores (locally, and on a new node from the remote tier with the copy back)
    are killed; the store must keep every generation, and the next restore works."""
    kills = budget(8, 60)
    tally, rng = _tally("crash: during restore (local, new node), POSIX")
    job = _job(tmp_path, keep_last=0)
    run = RunState()
    calibrate_saves(zygote, job, run)
    _, checked = check_restore(zygote, job, tally, -1, run.completed, run.newest)
    listing = next(e["listed"] for e in checked.events() if e["e"] == "tier")
    job.update(newest=run.completed, listing=sorted(map(tuple, listing)))
    calibration = calibrate_restores(zygote, job)
    for trial in range(kills):
        restore_trial(zygote, job, calibration, tally, trial, rng)
    _report(tally, kills, min_mid_operation=kills // 4)


def test_kills_during_replication(zygote: Zygote, tmp_path: Path) -> None:
    """Saves replicate to a second POSIX tier (retention on both); kills land in saves
    and, in every other trial, at a random mutation of the replication thread (copies
    and the replica's retention)."""
    kills = budget(8, 80)
    tally, rng = _tally("crash: during replication to a second tier, POSIX")
    replica = str(tmp_path / "replica")
    job = _job(tmp_path, replica=replica, tiers=[str(tmp_path / "store"), replica],
               restore_tiers=[replica], kill_thread="ckptvault-replicate")  # fmt: skip
    run = RunState()
    calibrate_saves(zygote, job, run)
    for trial in range(kills):
        save_trial(zygote, job, run, tally, trial, rng)
    check_restore(zygote, job, tally, kills - 1, run.completed, run.newest)
    _report(tally, kills, min_mid_operation=kills // 4)


def test_kills_during_gc(zygote: Zygote, tmp_path: Path) -> None:
    """``ckptvault gc --keep-last 1 --delete-delay 0s`` is killed at random moments and
    random filesystem mutations (marks, the rename out of the listing, the deletion,
    staging cleanup); the newest generation always restores, everything listed
    verifies, and a last uninterrupted gc finishes the job (the newest and its fallback
    left, no staging leftover)."""
    kills = budget(8, 80)
    tally, rng = _tally("crash: during ckptvault gc, POSIX")
    job = _job(tmp_path, ballast_mb=2, keep_last=0)
    calibration = calibrate_gc(zygote, job)
    for trial in range(kills):
        gc_trial(zygote, job, calibration, tally, trial, rng)
    final = zygote.start({**job, "mode": "gc", "saves": 1})
    assert final.join(120) == 0 and final.wait_for("gc-done", 1)["rc"] == 0, final.log()
    newest = max(final.steps("saved"))
    _, checked = check_restore(zygote, job, tally, kills, newest, newest)
    listing = next(e["listed"] for e in checked.events() if e["e"] == "tier")
    # keep-last 1, plus the fallback gc always keeps: an older generation that verifies
    assert [step for step, _ in listing][:1] == [newest] and len(listing) == 2, listing
    assert not os.listdir(tmp_path / "store" / ".staging")  # every leftover removed
    _report(tally, kills, min_mid_operation=kills // 4)
