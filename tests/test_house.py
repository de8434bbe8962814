"""The seams later features plug into: events, the coordinator, the layering."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.coordinator import Coordinator, SingleProcess
from ckptvault.events import Published, Refused, Restored
from conftest import REPO, only_tensor_file, writable

PACKAGE = REPO / "src" / "ckptvault"


def test_subscribers_hear_published_restored_and_refused(store: Path):
    heard: list[object] = []
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.events.subscribe(heard.append)
        first = mgr.save(1, {"x": torch.ones(4)}).result()
        second = mgr.save(2, {"x": torch.full((4,), 2.0)}).result()
        writable(only_tensor_file(Path(second.path))).write_bytes(b"\0" * 8)  # damage step 2
        info = mgr.restore({"x": torch.zeros(4)})
        with pytest.raises(cv.errors.NoValidCheckpoint):
            mgr.restore({"x": torch.zeros(4)}, step=2)
    published = [e for e in heard if isinstance(e, Published)]
    assert [(e.step, e.generation_id) for e in published] == [
        (1, first.generation_id),
        (2, second.generation_id),
    ]
    assert all(e.run_id == "r" and e.bytes > 0 and e.store == str(store) for e in published)
    restored = [e for e in heard if isinstance(e, Restored)]
    assert [(e.step, e.generation_id) for e in restored] == [(1, first.generation_id)]
    assert [s[0] for s in restored[0].skipped] == [second.generation_id] == [info.skipped[0][0]]
    refused = [e for e in heard if isinstance(e, Refused)]
    assert len(refused) == 1 and refused[0].error == "NoValidCheckpoint"
    assert [r[0] for r in refused[0].rejected] == [second.generation_id]


def test_a_failing_subscriber_says_the_generation_was_published(store: Path):
    def broken(event: object) -> None:
        raise cv.errors.AuditError("disk on fire")

    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.events.subscribe(broken)
        with pytest.raises(cv.errors.AuditError, match="disk on fire"):
            mgr.save(1, {"x": torch.ones(2)})
        # The event reports what already happened: the generation is there.
        assert [g.step for g in mgr.generations()] == [1]


def test_one_process_is_a_job_of_one_rank(store: Path):
    """Without a process group the manager is its own coordinator: rank 0 of 1 names
    the files and the manifest records one rank (many ranks: test_many_ranks.py)."""
    assert isinstance(SingleProcess(), Coordinator)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert isinstance(mgr.coordinator, SingleProcess)
        info = mgr.save(2, {"x": torch.ones(1)}).result()
        manifest = json.loads((Path(info.path) / "manifest.json").read_bytes())
        assert manifest["writer"]["world_size"] == 1
        assert sorted(manifest["files"]) == ["r00000-000.safetensors"]


def _imports(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
        elif isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
    return {m for m in modules if m.startswith("ckptvault")}


def _package_imports(package: str) -> dict[str, set[str]]:
    return {
        str(path.relative_to(PACKAGE)): _imports(path)
        for path in sorted((PACKAGE / package).rglob("*.py"))
    }


def test_dependencies_point_one_way():
    """format/ and errors sit at the bottom; trust/ never reaches into a backend."""
    bottom = {"ckptvault.errors", "ckptvault._version"}
    for module, imported in _package_imports("format").items():
        upward = {m for m in imported if m not in bottom and not m.startswith("ckptvault.format")}
        assert not upward, f"{module} imports {sorted(upward)}"
    assert _imports(PACKAGE / "errors.py") == set()
    for module, imported in _package_imports("trust").items():
        backends = {
            m
            for m in imported
            if m.startswith("ckptvault.storage") and m not in ("ckptvault.storage.base",)
        }
        assert not backends, f"{module} imports a storage backend: {sorted(backends)}"
        assert not {m for m in imported if m.startswith(("ckptvault.io", "ckptvault.manager"))}
    for module, imported in _package_imports("storage").items():
        upward = {
            m
            for m in imported
            if m.startswith(
                ("ckptvault.trust", "ckptvault.io", "ckptvault.state", "ckptvault.manager")
            )
        }
        assert not upward, f"{module} imports {sorted(upward)}"


def test_the_command_line_starts_without_torch():
    """``ckptvault ls``/``verify``/``status``/... start in a fraction of a second: loading
    the CLI must not import torch (2-3 s here); commands that need it import it late."""
    code = "import sys, ckptvault.cli; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_moved_modules_stay_importable_under_their_documented_paths():
    """``lifecycle/`` was split by idea; code that imports an old path (the README
    documented ``ckptvault.lifecycle.catalog.Catalog``) gets the very module now at
    its new place, without importing anything else first."""
    assert not (PACKAGE / "lifecycle").exists()
    code = (
        "import sys\n"
        "from ckptvault.lifecycle.catalog import Catalog\n"
        "import ckptvault.observe.catalog as new, ckptvault.lifecycle.collector as old\n"
        "import ckptvault.retention.collector as moved\n"
        "print(Catalog is new.Catalog, old is moved, 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "False"]
