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
from support.common import REPO, only_tensor_file, writable

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
    """``lifecycle/`` was split by idea and prefixes became folders; code that imports
    an old path (the README documented ``ckptvault.lifecycle.catalog.Catalog``,
    ``ckptvault.ops.rotate`` and ``ckptvault.ops.sign``) gets the very module now at its
    new place, without importing torch."""
    assert not (PACKAGE / "lifecycle").exists()
    code = (
        "import sys\n"
        "from ckptvault.lifecycle.catalog import Catalog\n"
        "import ckptvault.observe.catalog as new, ckptvault.lifecycle.collector as old\n"
        "import ckptvault.retention.collector as moved\n"
        "import ckptvault.storage.posix_files as files, ckptvault.storage.posix.files as f\n"
        "from ckptvault.storage.posix import PosixStore\n"
        "from ckptvault.storage.s3 import S3Store\n"
        "import ckptvault.trust.kms_names as kms_names, ckptvault.trust.kms.names as names\n"
        "print(Catalog is new.Catalog, old is moved, files is f, kms_names is names,\n"
        "      PosixStore.__module__, S3Store.__module__, 'torch' in sys.modules)\n"
        "from ckptvault.ops.rotate import rotate_run_key\n"
        "from ckptvault.ops.sign import sign_generations\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [
        "True",
        "True",
        "True",
        "True",
        "ckptvault.storage.posix.store",
        "ckptvault.storage.s3.store",
        "False",
    ]


# -- the house's layers ---------------------------------------------------------------
#
# Bottom to top; written down once here and in docs/contributing.md's layout. A module
# may import its own package and any package of a lower layer (or of its own layer,
# as long as no two packages import each other), never one above.
LAYERS: list[set[str]] = [
    {"errors", "_version", "exit_codes", "timing", "progress", "durable", "_moved", "aws"},
    {"format"},
    {"storage", "state", "engines", "events", "coordinator"},
    {"trust"},
    {"config", "run_context", "io"},
    {"saving", "retention", "observe", "planning"},
    {"distributed", "replication", "memory"},
    {"restoring"},
    {"dcp", "assembly", "writer_main"},
    {"manager"},
    {"integrations", "ops"},
    {"cli", "__main__", "__init__"},
]


def _package_of(module: str) -> str:
    """``ckptvault.retention.plan`` -> ``retention``; the package itself -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _import_graph() -> dict[str, set[str]]:
    """Every module of the package and the ckptvault modules it imports (anywhere in
    it: at the top, inside functions, under TYPE_CHECKING). ``from ckptvault import
    errors`` imports ``ckptvault.errors``, not the package's facade."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module == "ckptvault":
                    targets.update(f"ckptvault.{alias.name}" for alias in node.names)
                else:
                    targets.add(node.module)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t.startswith("ckptvault.") and t != name}
    return graph


def layer_violations(graph: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """Every import that runs up the layers, and every package missing from them."""
    level = {package: i for i, packages in enumerate(layers) for package in packages}
    found = []
    for module, targets in graph.items():
        source = _package_of(module)
        if source not in level:
            found.append(f"{module}: package {source!r} is in no layer")
            continue
        for target in sorted(targets):
            if level.get(_package_of(target), -1) > level[source]:
                found.append(f"{module} imports {target}, a higher layer")
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph.get(node, ())):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = _package_of(module)
        packages.setdefault(source, set()).update(
            _package_of(t) for t in targets if _package_of(t) != source
        )
    return packages


def test_no_package_and_no_module_imports_another_in_a_circle():
    graph = _import_graph()
    assert circles(_packages(graph)) == []
    assert circles(graph) == []


def test_every_import_points_down_the_layers():
    assert layer_violations(_import_graph(), LAYERS) == []


def test_the_house_checks_catch_a_circle_and_an_upward_arrow():
    """The checks above can fail: a planted circle and an upward import are found."""
    graph = _import_graph()
    graph["ckptvault.format.manifest"] = graph["ckptvault.format.manifest"] | {
        "ckptvault.manager"
    }
    graph["ckptvault.retention.plan"] = graph["ckptvault.retention.plan"] | {
        "ckptvault.replication.tiers"
    }
    assert "ckptvault.format.manifest imports ckptvault.manager, a higher layer" in (
        layer_violations(graph, LAYERS)
    )
    assert any({"retention", "replication"} <= set(c) for c in circles(_packages(graph)))
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
