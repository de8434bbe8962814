"""Every hostile generation of the corpus (``tests/hostile_corpus*.py``) through every
reader entry point a user or an operator has (``tests/hostile_points.py``): restore
(the newest that verifies, and the hostile step by name), ``verify_generation``,
listing (library and ``ckptvault ls``), ``ckptvault verify`` and ``ckptvault
inspect`` (in process) and ``export_weights``; some through ``ckptvault verify``,
``inspect`` and ``export`` as real subprocesses, and the enormous claims through
restore and export in a process with a limited address space. Generations are
planted in format 3 (a root manifest over per-rank indexes, what the writer
produces) and, for every attack format 2 is open to, in format 2 too: the reader
still accepts it, so an attacker can plant it.

For each entry and entry point (one trial) it checks:

a. the refusal: the entry's reason code, and restore falling back to the step the
   entry names (reporting the skip with that code) or raising exactly the entry's
   typed error with the caller's state untouched;
b. no code ran: the marker file a pickle payload would create never appears;
c. nothing outside the store was read: no path outside the store and the control
   plane was opened, listed or changed (audit hook), and no process opened or read
   the secrets' inodes through any name (inotify);
d. memory stayed bounded, by the bytes the attacker wrote, not by what they claim:
   the resident set's growth always, Python's allocations (tracemalloc) for the
   enormous claims and the malformed JSON. What the attacker wrote counts the root
   manifest and the indexes (those a reader may read: at most MAX_INDEX_BYTES each).
"""

from __future__ import annotations

import io
import json
import mmap
import os
import pickle
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import typer.main

import ckptvault as cv
from ckptvault.cli import app as cli_app
from ckptvault.errors import FormatError
from ckptvault.format.index import MAX_INDEX_BYTES
from ckptvault.format.tensorfile import parse_header
from ckptvault.ops.export import export_weights
from ckptvault.trust.keystore import LocalKeyStore
from support.common import make_training_state
from support.hostile_corpus import (
    CLAIMS,
    INDEXES,
    JSON,
    PATHS,
    PICKLE,
    REPLAY,
    TRUST,
    Hostile,
    entries,
)
from support.hostile_guards import AccessLog, InodeWatch, memory_meter
from support.hostile_plants import Bases, Plot, pickle_payload, torch_save_payload
from support.hostile_points import (
    ADDRESS_SPACE_LIMIT,
    POINTS,
    cli_arguments,
    cli_command,
    in_process_cli,
    judge_cli,
)
from support.reliability import long_run, record

MiB = 1024 * 1024
# Memory may follow the bytes an attacker really wrote into the manifest (capped at
# 64 MiB), by a constant factor for the parsed JSON; never the sizes, lengths and
# counts it claims.
PYTHON_PEAK = 16 * MiB
RESIDENT_GROWTH = 64 * MiB
PER_MANIFEST_BYTE = 12
TRACED = (CLAIMS,)  # Python allocations traced (a twofold slowdown) where claims are made

# One entry per category also runs as a real subprocess (every entry, three commands,
# under the long budget); the heaviest enormous claims run restore and ``ckptvault
# export`` in a worker process under RLIMIT_AS instead (every claim, long budget).
SUBPROCESS = {
    PICKLE: ("torch-save-archive-as-tensor-file", "verify"),
    PATHS: ("tensor-file-symlinked-to-identical-bytes", "inspect"),
    JSON: ("deeply-nested-manifest", "verify"),
    TRUST: ("generation-of-another-run", "verify"),
    REPLAY: ("segment-replayed-from-the-state-file", "inspect"),
    INDEXES: ("index-chunk-moved", "verify"),
}
LIMITED = (
    "tensor-entry-claims-a-trillion-elements",
    "container-claims-an-exabyte-of-plaintext",
    "index-chunk-claims-a-trillion-squared-elements",
    "table-claims-more-cells-than-any-root-may",
)


# -- the ground ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bases]:
    """The bases and plots of this module, on tmpfs where there is one: restore
    fsyncs its ledger, audit log and reader leases, which costs nothing there, and
    this file is about parsers and paths, not durability."""
    shm = Path("/dev/shm")
    fast = shm.is_dir() and os.access(shm, os.W_OK)
    root = (
        Path(tempfile.mkdtemp(prefix="ckptvault-hostile-", dir=shm))
        if fast
        else tmp_path_factory.mktemp("hostile")
    )
    try:
        yield Bases(root / "bases")
    finally:
        if fast:
            shutil.rmtree(root, onerror=_writable_then_retry)


def _writable_then_retry(function: Callable[..., object], path: str, _info: object) -> None:
    """Published generations are read-only: make the parent writable and retry."""
    os.chmod(os.path.dirname(path), 0o755)
    function(path)


@pytest.fixture
def bases(workspace: Bases, monkeypatch: pytest.MonkeyPatch) -> Bases:
    """The shared bases (warmed up once), the per-user state directory beside them,
    and the CLI's command built once rather than on every in-process call."""
    monkeypatch.setenv("XDG_STATE_HOME", str(workspace.directory.parent / "user-state"))
    command = typer.main.get_command(cli_app)
    monkeypatch.setattr(typer.main, "get_command", lambda _app: command)
    if not (workspace.directory / "plots" / "warm-up-plain").exists():
        warm_up(workspace)
    return workspace


def warm_up(bases: Bases) -> None:
    """Every entry point once on untampered copies: they must succeed (so each check
    of a trial can fail), and first-call imports do not count as a trial's memory."""
    for base in ("plain", "signed", "encrypted", "plain-f2", "signed-f2", "encrypted-f2"):
        plot = bases.plot(base, f"warm-up-{base}")
        with cv.CheckpointManager(plot.store, **plot.options()) as mgr:
            assert mgr.restore(make_training_state(seed=9)).step == 2
        for command in ("verify", "inspect"):
            code, _out, err = in_process_cli(*cli_arguments(command, plot, 2))
            assert code == 0, err
        out = plot.root / "export" / "model.safetensors"
        keystore = LocalKeyStore(plot.keystore) if plot.keystore else None
        ledger, audit = plot.control / "ledger.sqlite3", plot.control / "audit.jsonl"
        export_weights(
            plot.store, 2, out, run_id="r", trusted_keys=plot.trusted, keystore=keystore,
            ledger=ledger, audit_log=audit,
        )  # fmt: skip
        assert out.exists()


# -- one trial -------------------------------------------------------------------------------


def manifest_bytes(plot: Plot, step: int) -> int:
    """The size of the hostile generation's manifest (its root and the indexes a
    reader may read), counting plain files only."""
    total = 0
    for generation in plot.store.glob(f"step-{step:012d}.*"):
        if generation.is_symlink() or not generation.is_dir():
            continue  # never list through a link: the guards would see the test read
        for path in [generation / "manifest.json", *generation.glob("*-index.json")]:
            info = path.lstat() if os.path.lexists(path) else None
            if info is None or not stat.S_ISREG(info.st_mode):
                continue
            if path.name == "manifest.json" or info.st_size <= MAX_INDEX_BYTES:
                total += info.st_size
    return total


def guarded(
    point: str, plot: Plot, entry: Hostile, step: int, bases: Bases, watch: InodeWatch
) -> list[str]:
    """One trial: the entry point's own checks (a), then (b), (c) and (d)."""
    shutil.rmtree(plot.control)
    shutil.copytree(plot.root / "control.planted", plot.control)  # every point: one ledger
    log = AccessLog()
    try:
        with log.watching(), memory_meter(trace_python=entry.category in TRACED) as peak:
            problems = POINTS[point](plot, entry, step, bases)
    except Exception as exc:  # anything raw, or a typed error where none belongs
        problems = [f"raised {type(exc).__name__}: {str(exc)[:300]}"]
    problems += unsafe_effects(plot, watch)
    allowed = [*plot.allowed(), plot.root / "export", Path(os.environ["XDG_STATE_HOME"])]
    problems += [f"opened {escape}" for escape in log.escapes(bases.directory.parent, allowed)]
    supplied = PER_MANIFEST_BYTE * manifest_bytes(plot, step)
    if peak.python > PYTHON_PEAK + supplied:
        problems.append(f"Python allocations peaked at {peak.python / MiB:.1f} MiB")
    if peak.resident is not None and peak.resident > RESIDENT_GROWTH + supplied:
        problems.append(f"the resident set grew by {peak.resident / MiB:.1f} MiB")
    return problems


def unsafe_effects(plot: Plot, watch: InodeWatch) -> list[str]:
    """(b) and the inotify half of (c), which see subprocesses too."""
    ran = ["the pickle payload ran"] if plot.marker.exists() else []
    return ran + [f"touched {where}" for where in watch.drain()]


def subprocess_trials(plot: Plot, entry: Hostile, step: int, watch: InodeWatch) -> list[list[str]]:
    """``ckptvault verify``/``inspect``/``export`` as an operator runs them, under an
    address-space limit: one command in CI, all three under the long budget."""
    chosen = SUBPROCESS.get(entry.category)
    if long_run():
        commands = ["verify", "inspect", "export"]
    else:
        commands = [chosen[1]] if chosen and entry.name == chosen[0] else []
    trials = []
    for command in commands:
        env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
        args = cli_command(cli_arguments(command, plot, step))
        done = subprocess.run(args, capture_output=True, text=True, timeout=300, env=env)
        result = (done.returncode, done.stdout, done.stderr)
        problems = judge_cli(command, entry, result) + unsafe_effects(plot, watch)
        trials.append([f"subprocess {command}: {problem}" for problem in problems])
    return trials


# CI runs each entry through POINTS_PER_ENTRY of the entry points, chosen by a seeded
# rotation so that every entry point still meets many entries of every category in
# every run, and every pair over runs; the long budget (make reliability) runs all.
POINTS_PER_ENTRY = 2
SEED_ENV = "CKPTVAULT_CORPUS_SEED"


def corpus_seed() -> int:
    """The rotation's seed: ``$CKPTVAULT_CORPUS_SEED`` (to replay a run), else drawn
    and printed with every failure."""
    return int(os.environ.get(SEED_ENV) or int.from_bytes(os.urandom(2), "big"))


SEED = corpus_seed()


def points_for(index: int) -> list[str]:
    """The entry points the ``index``-th entry of a category goes through."""
    names = list(POINTS)
    if long_run():
        return names
    first = (SEED + index * POINTS_PER_ENTRY) % len(names)
    return [names[(first + k) % len(names)] for k in range(POINTS_PER_ENTRY)]


def run_category(category: str, bases: Bases) -> tuple[list[list[str]], dict[str, int]]:
    """Every entry of ``category`` through its entry points (every one under the long
    budget, a seeded rotation in CI: :func:`points_for`): per trial, what did not
    hold; and each entry's hostile step."""
    outcomes: list[list[str]] = []
    steps = {}
    for index, entry in enumerate(entries(category)):
        plot = bases.plot(entry.base, entry.name)
        steps[entry.name] = step = entry.plant(plot)
        shutil.copytree(plot.control, plot.root / "control.planted")
        watch = InodeWatch(plot.outside)
        try:
            for point in points_for(index):
                problems = guarded(point, plot, entry, step, bases, watch)
                outcomes.append([f"{entry.name} / {point}: {p}" for p in problems])
            for problems in subprocess_trials(plot, entry, step, watch):
                outcomes.append([f"{entry.name} / {p}" for p in problems])
        finally:
            watch.close()
    return outcomes, steps


def check(category: str, outcomes: list[list[str]], detail: str) -> None:
    failed = [problems for problems in outcomes if problems]
    record(category, len(outcomes), len(failed), detail)
    replay = f"(replay: {SEED_ENV}={SEED})\n"
    assert not failed, replay + "\n".join("\n    ".join(problems) for problems in failed)


# -- the tests -------------------------------------------------------------------------------


@pytest.mark.reliability
@pytest.mark.parametrize("category", [PICKLE, PATHS, JSON, TRUST, REPLAY, INDEXES])
def test_hostile_generations_are_refused(category: str, bases: Bases) -> None:
    outcomes, _steps = run_category(category, bases)
    detail = f"{len(entries(category))} entries x {len(points_for(0))} entry points, + subprocesses"
    check(category, outcomes, detail)


@pytest.mark.reliability
def test_enormous_claims_are_refused_in_bounded_memory(bases: Bases) -> None:
    """The enormous claims, and the heaviest of them again in a worker process whose
    address space is limited: restore, and ``ckptvault export``."""
    outcomes, steps = run_category(CLAIMS, bases)
    limited = [e for e in entries(CLAIMS) if long_run() or e.name in LIMITED]
    order = [[str(bases.directory / "plots" / e.name), e.base, steps[e.name]] for e in limited]
    worker = Path(__file__).resolve().parents[1] / "support" / "hostile_worker.py"
    done = subprocess.run(
        [sys.executable, str(worker), str(ADDRESS_SPACE_LIMIT), json.dumps(order)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "MALLOC_ARENA_MAX": "2"},
    )
    results = [json.loads(line) for line in done.stdout.splitlines()]
    if len(results) != len(limited):
        outcomes.append([f"the limited worker failed: {done.stderr[-2000:]}"])
    for entry, result in zip(limited, results, strict=False):
        restored = limited_restore(entry, steps[entry.name], result["restore"])
        exported = judge_cli("export", entry, tuple(result["export"]))
        outcomes.append([f"{entry.name} / limited restore: {p}" for p in restored])
        outcomes.append([f"{entry.name} / limited export: {p}" for p in exported])
    detail = (
        f"{len(entries(CLAIMS))} entries x {len(points_for(0))} points, {len(limited)} under RLIMIT_AS"
    )
    check(CLAIMS, outcomes, detail)


def limited_restore(entry: Hostile, step: int, outcome: dict) -> list[str]:
    """The worker's restore fell back as in this process."""
    skipped = [codes for skipped_step, codes in outcome.get("skipped", []) if skipped_step == step]
    if outcome.get("step") != entry.restores or not skipped or entry.code not in skipped[0]:
        return [f"restore: {outcome}, expected step {entry.restores} after {entry.code}"]
    return []


# -- the checks can fail -----------------------------------------------------------------------


def test_the_payloads_would_run_code(tmp_path: Path) -> None:
    """Unpickled, the corpus's payloads do run their command, so (b) can fail. (They
    only touch a file in this test's directory.)"""
    marker = tmp_path / "ran"
    pickle.loads(pickle_payload(marker))
    assert marker.exists()
    marker.unlink()
    torch.load(io.BytesIO(torch_save_payload(marker)), weights_only=False)
    assert marker.exists()


def test_the_guards_see_what_they_guard(tmp_path: Path) -> None:
    """(c) and (d) can fail: an open through a symlink or a hard link, a path
    outside the allowed roots, a large allocation."""
    outside, store = tmp_path / "outside", tmp_path / "store"
    outside.mkdir()
    store.mkdir()
    (outside / "secret").write_bytes(b"secret")
    (store / "link").symlink_to(outside / "secret")
    os.link(outside / "secret", store / "hard")
    watch = InodeWatch(outside)
    try:
        (store / "link").read_bytes()
        assert any(event.startswith("read ") for event in watch.drain())
        (store / "hard").read_bytes()
        assert any(event.startswith("open ") for event in watch.drain())
    finally:
        watch.close()
    log = AccessLog()
    with log.watching():
        (outside / "secret").read_bytes()
        os.listdir(store / ".." / "outside")
    escapes = log.escapes(tmp_path, [store])
    assert len(escapes) == 2 and all("secret" in e or ".." in e for e in escapes)
    with memory_meter() as peak:
        python_side = bytes(64 * MiB)
        # Native memory as torch takes it: a fresh mapping, every page written. (A
        # Python object may reuse heap this worker freed earlier, which is resident
        # already.) Alive to the block's end, where the resident set is read too.
        native = mmap.mmap(-1, 64 * MiB)
        for offset in range(0, 64 * MiB, mmap.PAGESIZE):
            native[offset] = 1
    native.close()
    del python_side
    assert peak.python >= 64 * MiB and (peak.resident is None or peak.resident >= 60 * MiB)


def test_a_tensor_header_holding_a_key_twice_is_refused() -> None:
    """Regression (the corpus's duplicated-key-in-a-tensor-header): a safetensors
    header naming one tensor twice parsed, the last one winning."""
    entry = '"t":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}'
    text = ("{" + entry + "," + entry + "}").encode()
    text += b" " * (-len(text) % 8)
    data = len(text).to_bytes(8, "little") + text + bytes(4)
    with pytest.raises(FormatError, match="holds the key 't' twice"):
        parse_header(data[: 8 + len(text)], len(data), "f.safetensors")


@pytest.mark.parametrize("category", [PICKLE, PATHS, JSON, TRUST, REPLAY, INDEXES, CLAIMS])
def test_the_rotation_takes_every_category_through_every_entry_point(category: str) -> None:
    """CI samples the entry points per entry: whatever the seed, each category still
    meets every entry point in every run (the long budget runs every pair)."""
    covered = {point for index in range(len(entries(category))) for point in points_for(index)}
    assert covered == set(POINTS)
