"""Simulated power loss, part 3: recording a scenario's save and judging every crash state.

:func:`record_save` builds a world (store, key store, audit log; the ledger beside
it) holding the generations a scenario starts from, restarts the run (a fresh
manager restores the newest generation, which also raises the rollback floor) and
records one more save. :func:`explore` builds every crash state of that save
(:mod:`power_loss_states`), opens each with a fresh manager as a restarted run
would, and judges what it restores:

- exactly the previous generation's state or exactly the new one's, bit for bit
  (none at all only where the save was the run's first);
- the new one once ``save()`` had returned (the last point of the log);
- no error at all, typed or not: the previous generation is always there to take;
- nothing skipped on the way: a generation the ledger saw published but the disk
  lost (the ledger written before the publish was durable) would be one;
- every generation the store lists verifies, and none but those ever published.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import ckptvault as cv
from ckptvault.errors import CheckpointError
from ckptvault.storage.posix.store import PosixStore
from ckptvault.trust.audit_verify import verify_audit_log
from ckptvault.trust.checks import TrustPolicy, verify_generation
from ckptvault.trust.ledger import Ledger
from ckptvault.trust.signing import TrustedKeys
from support.common import make_training_state, train_steps
from support.power_loss import Recorder
from support.power_loss_states import CrashState, crash_states, materialize

RUN_ID = "power"
Options = Callable[[Path, Path], dict[str, Any]]  # (world, ledger path) -> manager options


@dataclass(frozen=True)
class Scenario:
    name: str  # the reliability table's row
    options: Options
    history: int  # generations saved before the recorded save (steps 1..history)
    trusted: Path | None = None  # the public key verification insists on
    width: int = 16  # of the model's hidden layer: how much a save writes


@dataclass
class Recorded:
    scenario: Scenario
    recorder: Recorder
    previous: tuple[str, dict[str, bytes]] | None  # generation id, state fingerprint
    new: tuple[str, dict[str, bytes]]
    published: set[str]  # every generation id ever published in this world


@dataclass
class Outcome:
    restored: str | None = None  # generation id, None: nothing restored
    state: dict[str, bytes] = field(default_factory=dict)
    error: str | None = None
    listed: list[str] = field(default_factory=list)
    broken: list[str] = field(default_factory=list)  # listed but failing verification
    audit: list[str] = field(default_factory=list)  # the audit log's problems
    skipped: list[str] = field(default_factory=list)  # newer generations restore refused


def fingerprint(state: dict[str, Any]) -> dict[str, bytes]:
    """Everything a restore sets, as bytes: compared bit for bit."""

    def flat(prefix: str, value: Any, out: dict[str, bytes]) -> None:
        if isinstance(value, torch.Tensor):
            tensor = value.detach().cpu().contiguous()
            out[prefix] = repr((tensor.dtype, tuple(tensor.shape))).encode()
            out[prefix] += tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
        elif isinstance(value, dict):
            for key, item in value.items():
                flat(f"{prefix}.{key}", item, out)
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                flat(f"{prefix}[{index}]", item, out)
        else:
            out[prefix] = repr(value).encode()

    out: dict[str, bytes] = {}
    flat("model", state["model"].state_dict(), out)
    flat("optimizer", state["optimizer"].state_dict(), out)
    flat("scheduler", state["scheduler"].state_dict(), out)
    out["sampler"] = json.dumps(state["sampler_rng"].bit_generator.state, default=str).encode()
    out["meta"] = json.dumps(state["meta"]).encode()
    return out


def places(root: Path) -> tuple[Path, Path]:
    """The world and the ledger under ``root``. Crash states are built where the save
    was recorded: the ledger keeps audit heads by the log's path."""
    return root / "world", root / "ctl" / "ledger.sqlite3"


def record_save(scenario: Scenario, root: Path) -> Recorded:
    """Save ``scenario.history`` generations, restart, and record one more save;
    what it leaves under ``root`` is removed (the recorder holds it all)."""
    world, ledger = places(root)
    world.mkdir(parents=True)
    options = scenario.options(world, ledger)
    state = make_training_state(0, scenario.width)
    published = set()
    for step in range(1, scenario.history + 1):
        train_steps(state, 1)
        with cv.CheckpointManager(world / "store", **options) as mgr:
            published.add(mgr.save(step, state).result().generation_id)
    previous = None
    mgr = cv.CheckpointManager(world / "store", **options)
    try:
        if scenario.history:
            state = make_training_state(1, scenario.width)  # a restart: nothing carried over
            info = mgr.restore(state)
            assert info is not None and info.step == scenario.history
            previous = (info.generation_id, fingerprint(state))
        train_steps(state, 1)
        recorder = Recorder(world, ledger)
        with recorder.recording():
            info = mgr.save(scenario.history + 1, state).result()
        assert info is not None
    finally:
        mgr.close()
    recorder.check_complete()
    shutil.rmtree(world)
    shutil.rmtree(ledger.parent, ignore_errors=True)  # none without trust features
    published.add(info.generation_id)
    new = (info.generation_id, fingerprint(state))
    return Recorded(scenario, recorder, previous, new, published)


def open_crash_state(recorded: Recorded, crash: CrashState, root: Path) -> Outcome:
    """Build the crash state under ``root`` and restore from it as a restarted run."""
    world, ledger = places(root)
    materialize(crash.tree, world)
    if crash.ledger is not None:
        ledger.parent.mkdir(parents=True)
        ledger.write_bytes(crash.ledger)
    outcome = Outcome()
    try:
        state = make_training_state(7, recorded.scenario.width)
        options = recorded.scenario.options(world, ledger)
        with cv.CheckpointManager(world / "store", **options) as mgr:
            outcome.listed = [g.generation_id for g in mgr.generations(include_marked=True)]
            info = mgr.restore(state)
        if info is not None:
            outcome.restored, outcome.state = info.generation_id, fingerprint(state)
            outcome.skipped = [f"{s.generation_id}: {s.reason}" for s in info.skipped]
        outcome.broken = broken_generations(recorded.scenario, world / "store")
        outcome.audit = audit_problems(options, ledger)
    except CheckpointError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    except Exception as exc:  # an untyped error is a failure of its own
        outcome.error = f"untyped {type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(world, ignore_errors=True)
        shutil.rmtree(ledger.parent, ignore_errors=True)
    return outcome


def audit_problems(options: dict[str, Any], ledger: Path) -> list[str]:
    """What ``ckptvault audit verify`` would say of the log after the restore appended
    to it: a power loss must not make the log look tampered with."""
    path = options.get("audit_log")
    if path is None:
        return []
    if not Path(path).exists():  # nothing was ever recorded, or the log was lost
        head = Ledger(ledger).audit_head(str(Path(path).resolve()))
        return [] if head is None else [f"the log is gone, but the ledger recorded {head}"]
    return verify_audit_log(path, Ledger(ledger)).problems


def broken_generations(scenario: Scenario, location: Path) -> list[str]:
    """Listed generations that fail ``verify`` (signature included when signed)."""
    store = PosixStore(location)
    trusted = TrustedKeys.load([scenario.trusted]) if scenario.trusted else None
    policy = TrustPolicy(run_id=RUN_ID, trusted_keys=trusted)
    return [
        f"{ref.generation_id}: {report.problems[0]}"
        for ref in store.list_generations()
        if not (report := verify_generation(store, ref, policy)).ok
    ]


def judge(recorded: Recorded, outcome: Outcome, returned: bool) -> str | None:
    """What is wrong with ``outcome`` (None: nothing); ``returned``: save() had returned."""
    if outcome.error is not None:
        return f"restore raised {outcome.error}"
    if outcome.broken:
        return f"the store lists generations that do not verify: {outcome.broken}"
    if outcome.skipped:
        # Nothing half-written is ever listed, and the ledger records a publish only
        # once it is durable: a refused generation means one of them did not hold.
        return f"restore had to skip generations: {outcome.skipped}"
    if outcome.audit:
        return f"the audit log no longer verifies: {outcome.audit}"
    strangers = set(outcome.listed) - recorded.published
    if strangers:
        return f"the store lists generations never published: {sorted(strangers)}"
    new_id, new_state = recorded.new
    if outcome.restored == new_id:
        return None if outcome.state == new_state else "restored the new generation, not bit-exact"
    if returned:
        return f"save() had returned, yet restore took {outcome.restored or 'nothing'}"
    if recorded.previous is None:
        return None if outcome.restored is None else f"restored {outcome.restored} from nowhere"
    previous_id, previous_state = recorded.previous
    if outcome.restored != previous_id:
        return f"restored {outcome.restored}, neither the previous nor the new generation"
    return None if outcome.state == previous_state else "restored the previous one, not bit-exact"


@dataclass
class Exploration:
    points: int = 0
    states: int = 0  # crash states judged (points x variants)
    trials: int = 0  # distinct crash states built and restored
    failures: dict[str, str] = field(default_factory=dict)  # fingerprint -> what went wrong


def explore(recorded: Recorded, variants: tuple[str, ...], root: Path) -> Exploration:
    """Judge every crash state of the recorded save (each distinct one restored once,
    built in the recorded save's place under ``root``)."""
    recorder = recorded.recorder
    log = recorder.log
    found = Exploration(points=len(log) + 1)
    outcomes: dict[str, Outcome] = {}
    for crash in crash_states(recorder.base, recorder.base_ledger, log, variants):
        key = crash.fingerprint()
        if key not in outcomes:
            outcomes[key] = open_crash_state(recorded, crash, root)
        found.states += 1
        wrong = judge(recorded, outcomes[key], returned=crash.point == len(log))
        if wrong is not None and key not in found.failures:
            after = repr(log[crash.point - 1])[:100] if crash.point else "nothing"
            found.failures[key] = f"point {crash.point} (after {after}), {crash.variant}: {wrong}"
    found.trials = len(outcomes)
    return found
