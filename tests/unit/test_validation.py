"""Validation: a generation is loaded into freshly built objects and checked; the
catalog records it, retention keeps the newest validated generation, and a sample of
saves can be validated in the background."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import ckptvault as cv
from ckptvault.observe.catalog import Catalog
from support.common import run_cli


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 2)


def _factory():
    """A fresh model and a check: a forward pass with a finite loss."""

    def build():
        model = _model()

        def check(state):
            loss = state["model"](torch.ones(1, 8)).sum()
            return bool(torch.isfinite(loss))

        return {"model": model}, check

    return build


def _save(mgr: cv.CheckpointManager, step: int, poison: bool = False) -> torch.nn.Module:
    model = _model()
    with torch.no_grad():
        model.weight.add_(step)
        if poison:
            model.weight[0, 0] = float("nan")  # loads fine, computes garbage
    mgr.save(step, {"model": model})
    return model


def test_a_generation_that_loads_and_computes_is_validated(store: Path, tmp_path: Path):
    catalog = tmp_path / "catalog.sqlite3"
    with cv.CheckpointManager(store, run_id="r", catalog=catalog) as mgr:
        _save(mgr, 1)
        live = _save(mgr, 2)
        before = live.weight.detach().clone()
        result = mgr.validate(_factory(), step=1)
        assert result.ok and result.step == 1 and result.error is None
        assert torch.equal(live.weight, before)  # the live objects are never touched
    with Catalog(catalog) as records:
        validated = {g.step: g.validated_at for g in records.generations()}
    assert validated[1] is not None and validated[2] is None


def test_a_generation_whose_check_fails_is_recorded_as_a_failure(store: Path, tmp_path: Path):
    catalog = tmp_path / "catalog.sqlite3"
    with cv.CheckpointManager(store, run_id="r", catalog=catalog) as mgr:
        _save(mgr, 1, poison=True)
        result = mgr.validate(_factory())
    assert not result.ok and "check returned False" in (result.error or "")
    with Catalog(catalog) as records:
        failures = records.failures()
        assert [(f.kind, f.step, f.error) for f in failures] == [
            ("validation", 1, "ValidationError")
        ]
        assert all(g.validated_at is None for g in records.generations())


def test_validation_reads_below_the_rollback_floor_and_leaves_it(store: Path, tmp_path: Path):
    ledger = tmp_path / "state" / "ledger.sqlite3"
    with cv.CheckpointManager(store, run_id="r", ledger=ledger) as mgr:
        for step in (1, 2, 3):
            _save(mgr, step)
        mgr.restore({"model": _model()})  # the floor is at step 3 now
        assert mgr.validate(_factory(), step=1).ok  # an old generation still loads
        floor = mgr.trust.floor("r")
    assert floor is not None and floor.step == 3


def test_retention_never_prunes_the_newest_validated_generation(tmp_path: Path):
    def run(store: Path, validate: bool) -> list[int]:
        policy = cv.Retention(keep_last=1, delete_delay=0)
        catalog = tmp_path / f"{store.name}.sqlite3"
        with cv.CheckpointManager(store, run_id="r", retention=policy, catalog=catalog) as mgr:
            _save(mgr, 1)
            if validate:
                assert mgr.validate(_factory(), step=1).ok
            for step in range(2, 7):
                _save(mgr, step)
            return sorted(g.step for g in mgr.generations())

    assert 1 not in run(tmp_path / "plain", validate=False)  # without it, step 1 goes
    kept = run(tmp_path / "validated", validate=True)
    assert 1 in kept and 2 not in kept


def test_one_save_in_k_is_validated_in_the_background(store: Path, tmp_path: Path):
    catalog = tmp_path / "catalog.sqlite3"
    with cv.CheckpointManager(
        store, run_id="r", catalog=catalog, validate_every=2, validate_with=_factory()
    ) as mgr:
        for step in range(1, 6):
            _save(mgr, step)
    with Catalog(catalog) as records:
        validated = sorted(g.step for g in records.generations() if g.validated_at is not None)
    assert validated == [2, 4]


def test_the_validate_command(store: Path, tmp_path: Path):
    factory = tmp_path / "factory.py"
    factory.write_text(
        textwrap.dedent(
            """
            import torch

            def build():
                model = torch.nn.Linear(8, 2)
                check = lambda state: bool(torch.isfinite(state["model"](torch.ones(1, 8)).sum()))
                return {"model": model}, check
            """
        )
    )
    catalog = ["--catalog", str(tmp_path / "catalog.sqlite3")]
    with cv.CheckpointManager(store, run_id="r", catalog=False) as mgr:
        for step in (1, 2, 3):
            _save(mgr, step, poison=step == 2)
    args = [str(store), "--run-id", "r", "--factory", f"{factory}:build", *catalog]
    result = run_cli("validate", *args, "--json")
    assert result.returncode == 0, result.stderr
    assert [(r["step"], r["ok"]) for r in json.loads(result.stdout)] == [(3, True)]
    result = run_cli("validate", *args, "--every", "1", "--json")
    assert result.returncode == 1  # step 2 computes NaN
    assert [(r["step"], r["ok"]) for r in json.loads(result.stdout)] == [
        (3, True),
        (2, False),
        (1, True),
    ]
    result = run_cli("validate", str(store), "--run-id", "r", "--factory", "no_such_module:f")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


def test_a_factory_may_build_the_model_alone(store: Path):
    """The README's factory returns {"model": model} while the job saves the optimizer
    too: validation is strict over what the factory built, and only that (it was
    StateMismatchError on every save, so nothing was ever validated)."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with cv.CheckpointManager(store, run_id="r", catalog=False) as mgr:
        mgr.save(1, {"model": model, "optim": optimizer, "meta": {"epoch": 1}})
        result = mgr.validate(_factory(), step=1)
        assert result.ok, result.error

        def wrong_shape():
            return {"model": torch.nn.Linear(8, 3)}

        refused = mgr.validate(wrong_shape, step=1)
    assert not refused.ok and "StateMismatchError" in (refused.error or "")


def test_the_console_script_imports_the_factory_from_the_working_directory(
    store: Path, tmp_path: Path
):
    """``ckptvault validate --factory train:build`` as the README writes it, run by
    the installed ``ckptvault`` script from the directory holding train.py (the
    script's own directory was the only one on its import path)."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "train.py").write_text(
        "import torch\n\ndef build():\n    return {'model': torch.nn.Linear(8, 2)}\n"
    )
    with cv.CheckpointManager(store, run_id="r", catalog=False) as mgr:
        _save(mgr, 1)
    script = Path(sys.executable).with_name("ckptvault")
    args = [str(script), "validate", str(store), "--run-id", "r", "--factory", "train:build"]
    result = subprocess.run(
        [*args, "--json", "--catalog", str(tmp_path / "c.sqlite3")],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert [(r["step"], r["ok"]) for r in json.loads(result.stdout)] == [(1, True)]
