"""The reader entry points the hostile corpus runs every entry through, each with its
own check of the refusal (item a of ``tests/security/test_hostile_corpus.py``).

Each point takes the plot, the entry, the hostile generation's step and the bases
(for the weights a fallback must restore) and returns what did not hold, as text.
The CLI is judged from its exit status and output, whether it ran in this process
(:func:`in_process_cli`) or as a real subprocess (:func:`cli_command`).
"""

from __future__ import annotations

import io
import json
import re
import sys
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout

import torch

import ckptvault as cv
from ckptvault.cli import main
from ckptvault.errors import NoValidCheckpoint
from ckptvault.ops.export import export_weights
from ckptvault.storage.posix.store import PosixStore
from ckptvault.trust.checks import TrustPolicy, verify_generation
from ckptvault.trust.keystore import LocalKeyStore
from ckptvault.trust.signing import TrustedKeys
from support.common import make_training_state, model_snapshot
from support.hostile_corpus import Hostile
from support.hostile_plants import Bases, Plot

CODES = re.compile(r"(?:^|; )([a-z][a-z-]+): ")
# A subprocess CLI runs under this address-space limit: a reader that sized a buffer
# from a claimed length would fail (the claims are 4 GiB and up); ckptvault's own
# peak, torch included, is under 1 GiB.
ADDRESS_SPACE_LIMIT = 3 * 1024**3


def codes_of(reason: str) -> list[str]:
    return CODES.findall(reason)


def same_model(state: dict, weights: dict[str, torch.Tensor]) -> bool:
    now = model_snapshot(state["model"])
    return now.keys() == weights.keys() and all(torch.equal(now[k], weights[k]) for k in now)


def refusal_problems(exc: NoValidCheckpoint, entry: Hostile, step: int) -> list[str]:
    """The typed error is exactly the entry's, and names its code for ``step``."""
    problems = []
    if type(exc) is not entry.refusal:
        problems.append(f"raised {type(exc).__name__}, not {entry.refusal.__name__}")
    codes = [code for _gen, s, reason in exc.rejected if s == step for code in codes_of(reason)]
    if entry.code not in codes:
        problems.append(f"step {step} was rejected with {codes}, not {entry.code}: {exc}")
    return problems


def restore_newest(plot: Plot, entry: Hostile, step: int, bases: Bases) -> list[str]:
    """``restore(state)``: falls back to ``entry.restores`` and reports the skip with
    the entry's code, or raises the entry's error leaving the state untouched."""
    fresh = make_training_state(seed=9)
    before = model_snapshot(fresh["model"])
    try:
        with cv.CheckpointManager(plot.store, **plot.options()) as mgr:
            info = mgr.restore(fresh)
    except NoValidCheckpoint as exc:
        if entry.restores is not None:
            return [f"refused instead of restoring step {entry.restores}: {exc}"]
        problems = refusal_problems(exc, entry, step)
        return problems + ([] if same_model(fresh, before) else ["the state was changed"])
    if entry.restores is None or info is None:
        return [f"restored {info and info.step}, expected {entry.refusal.__name__}"]
    problems = []
    if info.step != entry.restores:
        problems.append(f"restored step {info.step}, not {entry.restores}")
    skipped = [(s.step, codes_of(s.reason)) for s in info.skipped]
    if len(skipped) != 1 or skipped[0][0] != step or entry.code not in skipped[0][1]:
        problems.append(f"skipped {skipped}, expected step {step} with {entry.code}")
    if not same_model(fresh, bases.weights[plot.base][info.step]):
        problems.append(f"the model is not step {info.step}'s")
    return problems


def restore_step(plot: Plot, entry: Hostile, step: int, bases: Bases) -> list[str]:
    """``restore(state, step=N)`` of the hostile step: the entry's error, state untouched."""
    fresh = make_training_state(seed=9)
    before = model_snapshot(fresh["model"])
    try:
        with cv.CheckpointManager(plot.store, **plot.options()) as mgr:
            info = mgr.restore(fresh, step=step)
    except NoValidCheckpoint as exc:
        problems = refusal_problems(exc, entry, step)
        return problems + ([] if same_model(fresh, before) else ["the state was changed"])
    return [f"restore(step={step}) applied step {info and info.step}"]


def verify_library(plot: Plot, entry: Hostile, step: int, bases: Bases) -> list[str]:
    store = PosixStore(plot.store)
    trusted = TrustedKeys.load(plot.trusted) if plot.trusted else None
    policy = TrustPolicy(run_id="r", trusted_keys=trusted)
    refs = [ref for ref in store.list_generations() if ref.step == step]
    reports = [verify_generation(store, ref, policy) for ref in refs]
    codes = [problem.code for report in reports for problem in report.problems]
    if entry.sees("verify") and (not refs or entry.code not in codes):
        return [f"verify reported {codes or 'no problem'}, not {entry.code}"]
    return []


def listing(plot: Plot, entry: Hostile, step: int, bases: Bases) -> list[str]:
    """``mgr.generations()`` and ``ckptvault ls --json`` list without failing."""
    with cv.CheckpointManager(plot.store, **plot.options()) as mgr:
        steps = {info.step for info in mgr.generations()}
    code, out, err = in_process_cli("ls", str(plot.store), "--json")
    problems = [] if 1 in steps else [f"listing lost step 1: {sorted(steps)}"]
    if code != 0 or {g["step"] for g in json.loads(out)} != steps:
        problems.append(f"ckptvault ls: exit {code}, {out[:200]!r} {err[:200]!r}")
    return problems


def export_library(plot: Plot, entry: Hostile, step: int, bases: Bases) -> list[str]:
    """``export_weights`` of the hostile step: the entry's error, nothing written."""
    out = plot.root / "export" / "model.safetensors"
    try:
        export_weights(
            plot.store,
            step,
            out,
            run_id="r",
            trusted_keys=plot.trusted,
            keystore=LocalKeyStore(plot.keystore) if plot.keystore else None,
            ledger=plot.control / "ledger.sqlite3",
            audit_log=plot.control / "audit.jsonl",
        )
    except NoValidCheckpoint as exc:
        problems = refusal_problems(exc, entry, step) if entry.sees("export") else []
        return problems + ([f"{out} was written"] if out.exists() else [])
    return [f"exported step {step}"] if entry.sees("export") else []


# -- the CLI ------------------------------------------------------------------------------


def in_process_cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def cli_arguments(command: str, plot: Plot, step: int) -> list[str]:
    """The command line an operator types for ``command`` on the hostile step."""
    args = [command, str(plot.store), "--step", str(step)]
    if command == "verify":
        args += ["--json", "--run-id", "r"]
    if command == "inspect":
        args += ["--json"]
    if command == "export":
        args += ["--out", str(plot.root / "export" / "cli.safetensors"), "--run-id", "r"]
        args += ["--ledger", str(plot.control / "ledger.sqlite3")]
        args += ["--audit-log", str(plot.control / "audit.jsonl")]
        args += ["--keystore", str(plot.keystore)] if plot.keystore else []
    if plot.trusted and command in ("verify", "export"):
        args += ["--trusted-key", str(plot.trusted[0])]
    return args


def judge_cli(command: str, entry: Hostile, result: tuple[int, str, str]) -> list[str]:
    """Exit 1 with the code in the JSON report (verify), or exit 2 with a last line
    naming it (inspect: one line only; export: after a warning per skipped
    generation); never a traceback or an internal error (exit 3)."""
    code, out, err = result
    sees = entry.sees(f"cli {command}") if command != "export" else entry.sees("export")
    if "Traceback" in err or code not in (0, 1, 2):
        return [f"ckptvault {command}: exit {code}: {err[-300:]}"]
    if command == "verify":
        codes = [p["code"] for report in json.loads(out or "[]") for p in report["problems"]]
        if sees and (code != 1 or entry.code not in codes):
            return [f"ckptvault verify: exit {code}, problems {codes}, not {entry.code}"]
        return []
    last = err.strip().splitlines()[-1:] or [""]  # export logs each skip before its error
    if sees and (code != 2 or entry.code not in last[0]):
        return [f"ckptvault {command}: exit {code}, {err[-300:]!r}, not {entry.code}"]
    if command == "inspect" and code == 2 and len(err.strip().splitlines()) != 1:
        return [f"ckptvault inspect printed more than one line: {err[-300:]!r}"]
    return []


def cli_verify(plot: Plot, entry: Hostile, step: int, bases: Bases) -> list[str]:
    return judge_cli("verify", entry, in_process_cli(*cli_arguments("verify", plot, step)))


def cli_inspect(plot: Plot, entry: Hostile, step: int, bases: Bases) -> list[str]:
    return judge_cli("inspect", entry, in_process_cli(*cli_arguments("inspect", plot, step)))


def cli_command(args: list[str]) -> list[str]:
    """``python -m ckptvault ARGS`` under :data:`ADDRESS_SPACE_LIMIT`."""
    limited = (
        "import resource, runpy, sys; "
        f"resource.setrlimit(resource.RLIMIT_AS, ({ADDRESS_SPACE_LIMIT}, {ADDRESS_SPACE_LIMIT})); "
        "sys.argv = ['ckptvault', *sys.argv[1:]]; "
        "runpy.run_module('ckptvault', run_name='__main__')"
    )
    return [sys.executable, "-c", limited, *args]


POINTS: dict[str, Callable[[Plot, Hostile, int, Bases], list[str]]] = {
    "restore": restore_newest,
    "restore step": restore_step,
    "verify": verify_library,
    "listing": listing,
    "cli verify": cli_verify,
    "cli inspect": cli_inspect,
    "export": export_library,
}
