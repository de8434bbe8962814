"""Old import paths of modules that moved, still importable.

The house was rearranged (``lifecycle/`` split into ``retention/``, ``replication/``,
``observe/`` and ``planning/``; backends into ``storage/posix/``, ``storage/s3/``;
key services into ``trust/kms/``). Code written against a documented old path, such
as ``from ckptvault.lifecycle.catalog import Catalog``, keeps working: a finder on
``sys.meta_path`` answers each old name with the module now at its new place (the
very same module object, so ``isinstance`` and monkeypatching agree). A moved
package's old name is an empty package whose submodules are found the same way.
Nothing is imported until an old name is asked for.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Sequence

# Old package name -> its modules' new homes (old module name -> new module path).
MOVED_PACKAGES: dict[str, dict[str, str]] = {
    "ckptvault.lifecycle": {
        "retention": "ckptvault.retention.policy",
        **{
            m: f"ckptvault.retention.{m}"
            for m in (
                "plan",
                "decisions",
                "apply",
                "marks",
                "keeper",
                "collector",
                "locks",
                "vouching",
            )
        },
        "leases": "ckptvault.storage.leases",
        "replication": "ckptvault.replication.replicator",
        "tiers": "ckptvault.replication.tiers",
        **{
            m: f"ckptvault.observe.{m}"
            for m in (
                "catalog",
                "catalog_attempts",
                "catalog_db",
                "catalog_recorder",
                "catalog_schema",
                "prometheus",
                "health",
                "usage",
            )
        },
        **{m: f"ckptvault.planning.{m}" for m in ("cadence", "sizing", "measured")},
        "metrics": "ckptvault.saving.metrics",
        "validation": "ckptvault.restoring.validation",
    },
}
# Old module name -> new module path (modules that moved one by one).
MOVED_MODULES: dict[str, str] = {
    **{
        f"{package}.{old}": new
        for package, modules in MOVED_PACKAGES.items()
        for old, new in modules.items()
    },
    **{
        f"ckptvault.storage.posix_{m}": f"ckptvault.storage.posix.{m}"
        for m in ("cleanup", "files", "publish", "records", "replace")
    },
    **{
        f"ckptvault.storage.s3_{m}": f"ckptvault.storage.s3.{m}"
        for m in (
            "cleanup",
            "client",
            "options",
            "publish",
            "read",
            "replace",
            "upload",
            "versions",
        )
    },
    **{
        f"ckptvault.trust.kms_{m}": f"ckptvault.trust.kms.{m}"
        for m in ("client", "erase", "keystore", "names", "rotation", "run_keys")
    },
    "ckptvault.ops.rotate": "ckptvault.ops.rotation.rotate",  # documented in the old README
    **{
        f"ckptvault.ops.rotation_{m}": f"ckptvault.ops.rotation.{m}"
        for m in ("journal", "report", "steps", "survey")
    },
    "ckptvault.ops.sign": "ckptvault.ops.signing.sign",  # documented in the old README
    "ckptvault.ops.sign_steps": "ckptvault.ops.signing.steps",
    "ckptvault.ops.doctor_s3": "ckptvault.ops.doctor.s3",
    # The key layout and the writer lease serve every object store (S3, Azure Blob).
    **{
        f"ckptvault.storage.s3{sep}{m}": f"ckptvault.storage.objects.{m}"
        for sep in ("_", ".")
        for m in ("layout", "lease")
    },
}


class _Alias(importlib.abc.Loader):
    def __init__(self, target: str | None) -> None:
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if self.target is None:  # an old package: empty, its submodules found by name
            module = types.ModuleType(spec.name, f"moved: see {__name__}")
            module.__path__ = []
            return module
        return importlib.import_module(self.target)

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the old names in :data:`MOVED_PACKAGES` and :data:`MOVED_MODULES`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in MOVED_PACKAGES:
            return importlib.machinery.ModuleSpec(fullname, _Alias(None), is_package=True)
        if fullname in MOVED_MODULES:
            return importlib.machinery.ModuleSpec(fullname, _Alias(MOVED_MODULES[fullname]))
        return None


def install() -> None:
    """Put the finder on ``sys.meta_path`` once."""
    if not any(isinstance(finder, MovedFinder) for finder in sys.meta_path):
        sys.meta_path.append(MovedFinder())
