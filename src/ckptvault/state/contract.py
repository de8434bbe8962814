"""The run contract: what the saved numbers mean.

A contract records the user's ``contract=`` fields (config, dataset identity, ...),
the code revision from git when there is one, and the torch, Python, NumPy and
ckptvault versions. Restore compares only the user fields: a changed config or
dataset raises :class:`ContractMismatch` naming each changed sub-field with its old
and new value (``config.lr: 3e-4 → 1e-4``, :mod:`ckptvault.state.contract_diff`),
unless the caller allows the change. Versions and revision are recorded for diagnosis.

Fields whose canonical JSON is larger than :data:`INLINE_LIMIT` bytes are stored as
their BLAKE3 digest, so a large config does not bloat every manifest but a change to
it is still detected.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import platform
import subprocess
from collections.abc import Mapping
from pathlib import PurePath
from typing import Any

from blake3 import blake3

from ckptvault.errors import ContractMismatch, FormatError, UsageError
from ckptvault.format.canonical import dumps_canonical
from ckptvault.state.codec import encode_plain
from ckptvault.state.contract_diff import ABSENT_VALUE as _ABSENT
from ckptvault.state.contract_diff import MAX_CHANGES, contract_changes
from ckptvault.state.environment import environment_versions

INLINE_LIMIT = 4096


def _normalize(value: Any) -> Any:
    """Make common config containers JSON-able: dataclasses, paths, enums."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _normalize(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, enum.Enum):
        return _normalize(value.value)
    if isinstance(value, Mapping):
        # Key order carries no meaning in a config: compare {"a":1,"b":2} == {"b":2,"a":1}.
        items = [(k, _normalize(v)) for k, v in value.items()]
        if all(isinstance(k, str) for k, _ in items):
            items.sort(key=lambda kv: kv[0])
        return dict(items)
    if type(value) is list:
        return [_normalize(v) for v in value]
    if type(value) is tuple:
        return tuple(_normalize(v) for v in value)
    return value


def encode_contract_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    encoded = {}
    for name, value in fields.items():
        if not isinstance(name, str):
            raise UsageError(f"contract field names must be str, got {name!r}")
        data = encode_plain(_normalize(value), ("contract", name))
        raw = dumps_canonical(data)
        if len(raw) > INLINE_LIMIT:
            data = {"$blake3": blake3(raw).hexdigest(), "bytes": len(raw)}
        encoded[name] = data
    return encoded


def code_revision(cwd: str | None = None) -> dict[str, Any] | None:
    """The git commit of the working directory, and whether it has local changes."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5
        )
        if commit.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "diff", "--quiet", "HEAD"], cwd=cwd, capture_output=True, timeout=10
        )
        return {"commit": commit.stdout.strip(), "dirty": dirty.returncode == 1}
    except (OSError, subprocess.SubprocessError):
        return None


def build_contract(
    fields: Mapping[str, Any] | None, revision: dict[str, Any] | None
) -> dict[str, Any]:
    return {
        "fields": encode_contract_fields(fields or {}),
        "code_revision": revision,
        "versions": environment_versions(),
        "host_os": os.uname().sysname if hasattr(os, "uname") else platform.system(),
    }


def compare_contracts(
    stored: Mapping[str, Any], current_fields: Mapping[str, Any], where: str
) -> None:
    """Raise :class:`ContractMismatch` if user fields differ; ``where`` names the generation.

    ``stored`` comes from the store: a contract that is not what :func:`build_contract`
    writes (fields not an object of named values) is a :class:`FormatError`.
    """
    saved = stored.get("fields", {}) if isinstance(stored, Mapping) else None
    if not isinstance(saved, Mapping) or not all(isinstance(name, str) for name in saved):
        raise FormatError(
            f"{where}: the manifest's run contract is malformed (its fields are not an "
            "object of named values); it was not written by ckptvault"
        )
    current = encode_contract_fields(current_fields)
    changed = sorted(
        name
        for name in set(saved) | set(current)
        if saved.get(name, "<absent>") != current.get(name, "<absent>")
    )
    if changed:
        details = [
            change
            for name in changed
            for change in contract_changes(
                saved.get(name, _ABSENT), current.get(name, _ABSENT), name
            )
        ]
        shown = "; ".join(details[:MAX_CHANGES])
        if len(details) > MAX_CHANGES:
            shown += f"; ... ({len(details)} changes in all)"
        raise ContractMismatch(
            f"{where} was saved under a different run contract (the checkpoint's value first): "
            f"{shown}. Restore with the original config and dataset, or pass "
            "allow_contract_change=True if the change is intended.",
            fields=changed,
        )
