"""The crash scenarios' trial loops: start children, kill them, check after each kill.

Each trial kills at a random moment chosen one of two ways, alternately:

- **timer**: the driver sleeps a random time (uniform over about three operations,
  measured in a calibration run) after the child is ready, then SIGKILLs it; kills
  land where the time goes (writing, hashing, uploading);
- **mutation**: the child SIGKILLs itself at a random store mutation (the n-th
  rename, unlink, rmdir, fsync, mkdir, ftruncate, or S3 write request, once ready; n
  uniform over about three operations' worth), so that short windows — between a
  rename and the fsync of its directory, inside a deletion, between an S3 request and
  its answer — are hit as often as long ones.

After every kill a fresh process restores and verifies
(:func:`crash_harness.check_events`): the restarted trainer, before it saves again,
or a ``check`` child (:func:`crash_harness.check_restore`). ``RunState`` carries what the driver knows
across trials: the last completed save and the newest save begun.
"""

from __future__ import annotations

import random
import socket
import time
from dataclasses import dataclass
from typing import Any

from support.crash_harness import Child, Tally, Zygote, check_events, check_restore

# What a rank that outlives its peer may raise (typed ckptvault errors only).
SURVIVOR_ERRORS = ("CollectiveError", "SaveFailedError")
READY_TIMEOUT = 120.0


@dataclass
class RunState:
    completed: int = -1  # newest step whose save completed (or that a restore saw)
    newest: int = -1  # newest step whose save began
    period: float = 0.3  # seconds per operation (calibrated)
    mutations: float = 20.0  # store mutations per operation (calibrated)

    def absorb(self, children: list[Child], durable_kind: str) -> None:
        for child in children:
            self.completed = max([self.completed, *child.steps(durable_kind)])
            self.newest = max([self.newest, *child.steps("begin")])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _ranks(zygote: Zygote, job: dict[str, Any], world: int, kill_at: dict[int, int]) -> list[Child]:
    port = free_port()
    return [
        zygote.start(
            {**job, "mode": "save", "world": world, "rank": rank, "port": port}
            | ({"kill_at": kill_at[rank]} if rank in kill_at else {})
        )
        for rank in range(world)
    ]


def _durable_kind(job: dict[str, Any]) -> str:
    return "durable" if job.get("async") else "saved"


def calibrate_saves(zygote: Zygote, job: dict[str, Any], run: RunState, world: int = 1) -> None:
    """One uninterrupted run of a few saves: their pace and store mutations."""
    children = _ranks(zygote, {**job, "more": 4}, world, {})
    for child in children:
        code = child.join(300)
        assert code == 0, f"calibration run exited {code}: {child.events()[-3:]} {child.log()}"
    events = children[0].events()
    ready = next(e["t"] for e in events if e["e"] == "ready")
    done = max(e["t"] for e in events if e["e"] == _durable_kind(job))
    run.period = (done - ready) / 4
    run.mutations = max(1.0, next(e for e in events if e["e"] == "finished")["calls"] / 4)
    run.absorb(children, _durable_kind(job))


def _check_ready(children: list[Child], run: RunState, tally: Tally, trial: int) -> bool:
    """Every rank restarted and restored at least the last completed save, bit-exactly;
    one rank (the trainer restarted after a kill) also checked everything
    :func:`check_events` judges."""
    for child in children:
        if child.wait_for("ready", READY_TIMEOUT) is None:
            tally.fail(trial, f"child never ready: {child.events()[-2:]} {child.log()}")
            return False
    if len(children) == 1:
        run.completed = check_events(children[0], tally, trial - 1, run.completed, run.newest)
        return True
    seen = run.completed
    for child in children:
        restored = next(e for e in child.events() if e["e"] == "restored")
        if restored["step"] < run.completed or restored["wrong"] or restored["skipped"]:
            tally.fail(trial, f"the restarted job restored {restored}, completed {run.completed}")
        seen = max(seen, restored["step"])
    run.completed = seen  # what a restore saw must never be lost
    return True


def _survivors_fail_typed(survivors: list[Child], tally: Tally, trial: int) -> None:
    """A rank that outlived its peer must raise a typed error (and exit), not hang."""
    for child in survivors:
        code = child.join(60)
        error = next((e for e in child.events() if e["e"] in ("error", "crash")), None)
        if code != 3 or error is None or error["type"] not in SURVIVOR_ERRORS:
            tally.fail(trial, f"survivor exited {code} with {error}: {child.log()}")


def save_trial(
    zygote: Zygote,
    job: dict[str, Any],
    run: RunState,
    tally: Tally,
    trial: int,
    rng: random.Random,
    world: int = 1,
) -> None:
    """One kill of a save loop (of ``world`` ranks). The check of the kill before
    comes first (the restarted trainer's), or, with many ranks, right after it."""
    at_mutation = trial % 2 == 1
    victims = list(range(world))
    if world > 1 and trial % 4 >= 2:  # one rank dies; the others must fail typed
        victims = [rng.randrange(world)]
    elif world > 1:
        at_mutation = False  # the whole job dies at one moment: a timer kill of every rank
    kill_at = {v: rng.randint(1, max(1, round(3 * run.mutations))) for v in victims}
    # One process: the restarted trainer checks the last kill (restore, every tier
    # verified) before it saves again; many ranks: a one-process check after the kill.
    children = _ranks(zygote, {**job, "verify": world == 1}, world, kill_at if at_mutation else {})
    if not _check_ready(children, run, tally, trial):
        for child in children:
            child.kill()
        return
    if at_mutation:
        for victim in victims:
            if children[victim].join(READY_TIMEOUT) != -9:
                tally.fail(trial, f"no self-kill: {children[victim].events()[-2:]}")
    else:
        time.sleep(rng.uniform(0, 3 * run.period))
        for victim in victims:  # every victim at the same moment, then reap them
            children[victim].send_kill()
        for victim in victims:
            children[victim].kill()
    _survivors_fail_typed([c for r, c in enumerate(children) if r not in victims], tally, trial)
    tally.kills += 1
    run.absorb(children, _durable_kind(job))
    if any(_mid_save(children[v], job) for v in victims):
        tally.mid_operation += 1
    if world > 1:
        run.completed, _ = check_restore(zygote, job, tally, trial, run.completed, run.newest)


def _mid_save(child: Child, job: dict[str, Any]) -> bool:
    """Whether a save was in progress when the child died (begun, not completed)."""
    begun = child.steps("begin")
    done = child.steps(_durable_kind(job))
    return any(e["e"] == "self-kill" for e in child.events()) or (
        bool(begun) and max(begun) > max(done, default=-1)
    )


def _kill(child: Child, at_mutation: bool, window: float, rng: random.Random) -> bool:
    """Kill ``child`` after its ``ready`` (timer), or wait for its self-kill; whether
    it died before finishing (``finished`` not reported)."""
    if not at_mutation:
        time.sleep(rng.uniform(0, window))
        child.kill()
    else:
        child.join(READY_TIMEOUT)
    return not any(e["e"] == "finished" for e in child.events())


def _calibrate(zygote: Zygote, job: dict[str, Any], start: str, end: str) -> tuple[float, int]:
    """One uninterrupted run of ``job``: seconds from ``start`` to ``end``, mutations."""
    child = zygote.start(job)
    code = child.join(300)
    assert code == 0, f"calibration run exited {code}: {child.events()[-3:]} {child.log()}"
    events = child.events()
    began = next(e["t"] for e in events if e["e"] == start)
    ended = next(e["t"] for e in events if e["e"] == end)
    return ended - began, next(e for e in events if e["e"] == "finished")["calls"]


def restore_trial(
    zygote: Zygote,
    job: dict[str, Any],
    calibration: dict[str, tuple[float, int]],
    tally: Tally,
    trial: int,
    rng: random.Random,
) -> None:
    """Kill a restore (on this node, or a new node's restore from the remote tier and
    its copy back); the store must still hold every generation, all restorable."""
    variant = "new node" if trial % 2 else "local"
    seconds, calls = calibration[variant]
    at_mutation = trial % 4 >= 2 and calls > 0
    fresh = f"{job['workdir']}/node{trial}" if variant == "new node" else None
    run = {**job, "mode": "restore", "fresh": fresh}
    if at_mutation:
        run["kill_at"] = rng.randint(1, calls)
    child = zygote.start(run)
    if child.wait_for("ready", READY_TIMEOUT) is None:
        tally.fail(trial, f"restore never ready: {child.log()}")
        return
    tally.mid_operation += _kill(child, at_mutation, 1.2 * seconds, rng)
    tally.kills += 1
    check = {**job, "tiers": [job["store"], *([fresh] if fresh else [])]}
    newest = job["newest"]
    _, checked = check_restore(zygote, check, tally, trial, newest, newest)
    tiers = {e["location"]: e["listed"] for e in checked.events() if e["e"] == "tier"}
    if sorted(map(tuple, tiers.get(job["store"], []))) != job["listing"]:
        tally.fail(trial, f"the store changed: {tiers.get(job['store'])} != {job['listing']}")
    if fresh and not {tuple(g) for g in tiers.get(fresh, [])} <= set(job["listing"]):
        tally.fail(trial, f"the new node holds what the store never did: {tiers[fresh]}")


def calibrate_restores(zygote: Zygote, job: dict[str, Any]) -> dict[str, tuple[float, int]]:
    return {
        "local": _calibrate(zygote, {**job, "mode": "restore"}, "ready", "finished"),
        "new node": _calibrate(
            zygote,
            {**job, "mode": "restore", "fresh": f"{job['workdir']}/calibration-node"},
            "ready",
            "finished",
        ),
    }


def calibrate_gc(zygote: Zygote, job: dict[str, Any]) -> tuple[float, int]:
    """A first gc run leaves two generations; the second, measured, has a trial's
    work: two more saved, two deleted."""
    _calibrate(zygote, {**job, "mode": "gc", "saves": 2}, "ready", "gc-done")
    return _calibrate(zygote, {**job, "mode": "gc", "saves": 2}, "ready", "gc-done")


def gc_trial(
    zygote: Zygote,
    job: dict[str, Any],
    calibration: tuple[float, int],
    tally: Tally,
    trial: int,
    rng: random.Random,
) -> None:
    """Finish the last kill's gc (it must succeed, leaving the newest generation and
    its fallback), save two generations, kill ``ckptvault gc --keep-last 1`` at a
    random moment; the newest generation must restore exactly, every listed one must
    verify."""
    seconds, calls = calibration
    at_mutation = trial % 2 == 1
    child = zygote.start(
        {**job, "mode": "gc", "saves": 2}
        | ({"kill_at": rng.randint(1, calls)} if at_mutation else {})
    )
    if child.wait_for("ready", READY_TIMEOUT) is None:
        tally.fail(trial, f"gc run never ready: {child.events()[-2:]} {child.log()}")
        return
    recovered = next((e for e in child.events() if e["e"] == "recovered"), None)
    if recovered is not None and (recovered["rc"] != 0 or len(recovered["listed"]) != 2):
        # After a killed gc, the same command finishes the job: the newest and its fallback.
        tally.fail(trial, f"gc after the last kill did not finish: {recovered} {child.log()}")
    tally.mid_operation += _kill(child, at_mutation, 1.2 * seconds, rng)
    tally.kills += 1
    newest = max(child.steps("saved"))
    check_restore(zygote, job, tally, trial, newest, newest)
