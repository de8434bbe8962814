"""The machinery of the corruption sweep (``tests/reliability/test_corruption.py``).

A sweep saves a small generation (step 2, the target) after a good one (step 1),
copies the target into a second store where it is alone, and then flips single
bytes of the target's files in place, in both copies at once. After each flip:

- ``verify_generation`` (what ``ckptvault verify`` runs) must report a problem;
- restore from the store where the target is alone must raise ``NoValidCheckpoint``
  (the contract when generations exist but none verifies) and leave the fresh
  state it was given untouched, global RNGs included;
- restore from the store that also holds step 1 must fall back to step 1, report
  the target in ``RestoreInfo.skipped``, and leave the state bit for bit as step 1
  saved it.

Then the byte is put back (in a ``finally``), so a trial never inherits its
predecessor's damage; a flip that went undetected also puts the ledgers back, since
restoring the target raised the rollback floor. A flip that passes any check is a
failure; so is any other outcome (a raw exception, another error type, a touched
state). Flipping in place keeps a trial at a few tens of milliseconds, nearly all
of it the two restores.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

import ckptvault as cv
from ckptvault.errors import CheckpointError, NoValidCheckpoint
from ckptvault.storage.base import GenerationRef
from ckptvault.storage.posix.store import PosixStore
from ckptvault.trust.checks import TrustPolicy, verify_generation
from support.reliability import budget, long_run

# Three patterns everywhere (lowest bit, highest bit, every bit); every single bit
# where the file is small enough to afford it.
PATTERNS = (0x01, 0x80, 0xFF)
EVERY_BIT = (0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0xFF)
RUN = "sweep"
MANIFEST = "manifest.json"


# -- the state saved ------------------------------------------------------------------


def small_state(seed: int) -> dict[str, Any]:
    """A few small tensors (float and int64 buffers), optimizer, scheduler, RNGs and
    JSON leaves: every kind of entry a state tree holds."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        "sampler_rng": np.random.default_rng(seed),
        "rng": cv.RNGState(),
        "meta": {"tokens_seen": 0, "losses": [], "tag": "sweep"},
    }


def train(state: dict[str, Any], steps: int) -> None:
    model, opt = state["model"], state["optimizer"]
    for _ in range(steps):
        x = torch.randn(4, 3) + float(state["sampler_rng"].integers(0, 10))
        opt.zero_grad(set_to_none=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        state["scheduler"].step()
        state["meta"]["tokens_seen"] += 4
        state["meta"]["losses"].append(loss.item())


def _exact(value: Any) -> Any:
    """A comparable, bit-exact form of nested tensors, arrays and plain values."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.numpy().tobytes())
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, dict):
        return tuple(sorted((repr(k), _exact(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_exact(v) for v in value)
    if isinstance(value, float):
        return ("float", struct.pack("<d", value))
    return value


def fingerprint(state: dict[str, Any]) -> Any:
    """Everything a restore sets: the objects' states, the JSON leaves, the
    generator's state and the global RNGs (torch, numpy, python). Tensors and arrays
    by their bytes; plain values by ``repr``, which round-trips floats exactly."""
    name, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
    return (
        _exact(state["model"].state_dict()),
        _exact(state["optimizer"].state_dict()),
        repr(state["scheduler"].state_dict()),
        json.dumps(state["meta"], sort_keys=True),
        repr(state["sampler_rng"].bit_generator.state),
        _exact(torch.get_rng_state()),
        (name, _exact(keys), position, has_gauss, repr(gauss)),
        repr(random.getstate()),
    )


# -- flips ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Region:
    """Bytes ``start..end`` of ``file`` in the target generation."""

    file: str
    start: int
    end: int


@dataclass(frozen=True)
class Flip:
    file: str
    offset: int
    pattern: int

    def __str__(self) -> str:
        return f"{self.file}[{self.offset}] ^= 0x{self.pattern:02x}"


def choose_flips(
    regions: Sequence[Region],
    patterns: Sequence[int],
    ci: int,
    rng: random.Random,
    long_cap: int | None = None,
) -> list[Flip]:
    """Under the long budget every byte of ``regions`` once, the patterns taking
    turns byte by byte (any change of a byte must be caught; three flips of each of
    51,000 manifest bytes took 10 minutes for nothing more), or at most ``long_cap``
    flips (bulk tensor bytes: a sample). ``ci`` flips otherwise: the first and last
    byte of each region with every pattern, the rest drawn by ``rng`` from the
    remaining bytes and patterns."""
    every = [
        Flip(r.file, offset, pattern)
        for r in regions
        for offset in range(r.start, r.end)
        for pattern in patterns
    ]
    if long_run() and long_cap is None:
        return [
            Flip(r.file, offset, patterns[offset % len(patterns)])
            for r in regions
            for offset in range(r.start, r.end)
        ]
    count = budget(ci, len(every) if long_cap is None else min(len(every), long_cap))
    if count >= len(every):
        return every
    ends = {(r.file, offset) for r in regions for offset in (r.start, r.end - 1)}
    must = [f for f in every if (f.file, f.offset) in ends]
    rest = [f for f in every if (f.file, f.offset) not in ends]
    return must + rng.sample(rest, max(0, min(len(rest), count - len(must))))


def tensor_file_regions(path: Path) -> tuple[Region, Region]:
    """(header, data) of a safetensors file: the 8-byte length and the JSON header,
    then the tensor bytes."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return Region(path.name, 0, 8 + length), Region(path.name, 8 + length, len(data))


def whole_file(path: Path) -> Region:
    return Region(path.name, 0, path.stat().st_size)


# -- the two stores -------------------------------------------------------------------


@dataclass
class Sweep:
    """The target generation in two stores, and what each trial found."""

    older: cv.CheckpointManager  # step 1 (good) and the target
    alone: cv.CheckpointManager  # a copy of the target, nothing else
    copies: tuple[Path, Path]  # the target's directory in each store
    verify_store: PosixStore
    ref: GenerationRef
    policy: TrustPolicy
    step1: Any  # fingerprint of the state step 1 saved
    originals: dict[str, bytes] = field(default_factory=dict)
    ledgers: dict[Path, bytes] = field(default_factory=dict)  # the files of both ledgers
    codes: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    trials: int = 0

    @property
    def target(self) -> Path:
        return self.copies[0]

    def close(self) -> None:
        self.older.close()
        self.alone.close()


def build_sweep(root: Path, options: Callable[[str], dict[str, Any]]) -> Sweep:
    """Save steps 1 and 2 into ``root/older``, copy step 2 into ``root/alone``, and
    open a manager on each (``options(name)`` gives each store's trust options).
    Checks that the pristine target verifies and restores bit-exactly: otherwise
    every flip would look detected."""
    state = small_state(seed=0)
    train(state, 2)
    with cv.CheckpointManager(root / "older", run_id=RUN, **options("older")) as mgr:
        step1 = fingerprint(state)
        mgr.save(1, state)
        train(state, 2)
        step2 = fingerprint(state)
        target = Path(mgr.save(2, state).result().path)
    copy = root / "alone" / target.name
    shutil.copytree(target, copy)
    for directory in (target, copy):
        for file in directory.iterdir():
            file.chmod(0o644)  # published read-only; the sweep rewrites bytes in place
    store = PosixStore(root / "older")
    (ref,) = [g for g in store.list_generations() if g.step == 2]
    older = cv.CheckpointManager(root / "older", run_id=RUN, **options("older"))
    alone = cv.CheckpointManager(root / "alone", run_id=RUN, **options("alone"))
    sweep = Sweep(
        older, alone, (target, copy), store, ref, older.trust.policy(RUN, floor=None), step1
    )
    sweep.originals = {f.name: f.read_bytes() for f in sorted(target.iterdir())}
    assert verify_generation(store, ref, sweep.policy).ok, "the pristine target must verify"
    fresh = small_state(seed=7)
    info = alone.restore(fresh)  # never the older store: its floor would rise to 2
    assert info is not None and info.step == 2, info
    assert fingerprint(fresh) == step2, "the pristine target must restore bit-exactly"
    for manager in (older, alone):
        if manager.trust.ledger is not None:
            folder = manager.trust.ledger.path.parent
            sweep.ledgers |= {f: f.read_bytes() for f in folder.iterdir() if f.is_file()}
    return sweep


def _reset_ledgers(sweep: Sweep) -> None:
    """Put the ledgers back as they were before the sweep. A flip that went
    undetected in the older store restored the target and raised the rollback floor
    to its step; every later trial would then fail for that one flip."""
    for path, data in sweep.ledgers.items():
        path.write_bytes(data)
    for folder in {path.parent for path in sweep.ledgers}:
        for path in folder.iterdir():
            if path not in sweep.ledgers:
                path.unlink()


# -- one trial ------------------------------------------------------------------------


def _write_byte(path: Path, offset: int, value: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        handle.write(bytes([value]))


def run_flip(sweep: Sweep, flip: Flip, reseal: Callable[[Path, str], None] | None = None) -> None:
    """Flip one byte in both copies, check every outcome, put the byte back.

    ``reseal(copy, file)``, when given, is what an attacker does after the flip
    (rewrite the digests that cover the file); the manifest is put back too."""
    original = sweep.originals[flip.file][flip.offset]
    for copy in sweep.copies:
        _write_byte(copy / flip.file, flip.offset, original ^ flip.pattern)
        if reseal is not None:
            reseal(copy, flip.file)
    try:
        problems = [_check_verify(sweep), _check_alone(sweep), _check_older(sweep)]
    finally:
        for copy in sweep.copies:
            _write_byte(copy / flip.file, flip.offset, original)
            if reseal is not None:
                (copy / MANIFEST).write_bytes(sweep.originals[MANIFEST])
    sweep.trials += 1
    found = "; ".join(p for p in problems if p)
    if found:
        sweep.failures.append(f"{flip}: {found}")
        _reset_ledgers(sweep)


def _code(reason: str) -> str:
    return reason.split(":", 1)[0]


def _check_verify(sweep: Sweep) -> str | None:
    try:
        report = verify_generation(sweep.verify_store, sweep.ref, sweep.policy)
    except Exception as exc:  # verify reports bad generations; it never raises for one
        return f"verify raised {type(exc).__name__}: {exc}"
    if report.ok:
        return "verify passed the corrupted generation"
    sweep.codes.update(f"verify {p.code}" for p in report.problems)
    return None


def _check_alone(sweep: Sweep) -> str | None:
    fresh = small_state(seed=7)
    before = fingerprint(fresh)
    try:
        info = sweep.alone.restore(fresh)
    except NoValidCheckpoint as exc:
        sweep.codes.update(f"restore {_code(reason)}" for _, _, reason in exc.rejected)
        if [(gen, step) for gen, step, _ in exc.rejected] != [(sweep.ref.generation_id, 2)]:
            return f"restore refused, but listed {exc.rejected}, not the corrupted generation"
        if fingerprint(fresh) != before:
            return "restore raised but changed the state it was given"
        return None
    except CheckpointError as exc:
        return f"restore raised {type(exc).__name__}, not NoValidCheckpoint: {exc}"
    except Exception as exc:
        return f"restore raised an untyped {type(exc).__name__}: {exc}"
    if info is None:
        return "restore of the lone corrupted generation returned None"
    return f"restore of the lone corrupted generation returned step {info.step}"


def _check_older(sweep: Sweep) -> str | None:
    fresh = small_state(seed=7)
    try:
        info = sweep.older.restore(fresh)
    except Exception as exc:
        return f"restore beside a good step 1 raised {type(exc).__name__}: {exc}"
    if info is None or info.step != 1:
        return f"restore beside a good step 1 gave {info and info.step}, not step 1"
    if [(s.generation_id, s.step) for s in info.skipped] != [(sweep.ref.generation_id, 2)]:
        return f"restore fell back to step 1 but reported skipping {info.skipped}"
    if fingerprint(fresh) != sweep.step1:
        return "restore fell back to step 1 but the state differs from what step 1 saved"
    return None


def sweep_detail(sweep: Sweep, seed: int, flips: Sequence[Flip]) -> str:
    """The reliability table's note: seed, what was flipped, what caught it."""
    files = Counter(f.file for f in flips)
    caught = ", ".join(f"{code} {n}" for code, n in sorted(sweep.codes.items()))
    return f"seed {seed}; flips per file {dict(files)}; caught by: {caught}"


def failure_report(sweep: Sweep, seed: int) -> str:
    shown = "\n  ".join(sweep.failures[:20])
    more = len(sweep.failures) - 20
    return (
        f"{len(sweep.failures)} of {sweep.trials} flips not handled (seed {seed}):\n  {shown}"
        + (f"\n  ... and {more} more" if more > 0 else "")
    )
