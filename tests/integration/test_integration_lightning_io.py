"""``CkptvaultCheckpointIO`` called directly, as Lightning's strategy calls it: the
pointer files are read as hostile input, removals with a delay mark first and the
store's records hand what is still to go to the next process, ``map_location``
and what the plugin refuses; and only the integration itself imports Lightning."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import FormatError
from support.common import REPO

pytest.importorskip("lightning.pytorch")
from ckptvault.integrations.lightning import CkptvaultCheckpointIO


def _lightning_like(step: int) -> dict[str, Any]:
    weights = torch.nn.Linear(2, 2).state_dict()
    return {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2",
        "state_dict": weights,
    }


def test_a_removal_with_a_delay_marks_first_and_deletes_later(tmp_path: Path):
    """delete_delay: the generation Lightning removed is marked (not a restore
    candidate, undeletable) and deleted by the first removal after the delay."""
    store, ckpt = tmp_path / "store", tmp_path / "ckpt"
    plugin = CkptvaultCheckpointIO(store, run_id="r", delete_delay=3600)
    for step in (1, 2, 3):
        plugin.save_checkpoint(_lightning_like(step), ckpt / f"step={step}.ckpt")
    plugin.remove_checkpoint(ckpt / "step=1.ckpt")  # 2 is the fallback, 3 the newest
    plugin.remove_checkpoint(ckpt / "step=2.ckpt")
    listed = {g.step: g for g in plugin.manager.generations(include_marked=True)}
    assert sorted(listed) == [1, 2, 3]
    assert listed[1].mark_reason is not None and listed[2].mark_reason is None
    assert sorted(p.name for p in ckpt.iterdir()) == ["step=3.ckpt"]
    plugin.teardown()

    # A later process, after the delay: the store's records say what was released.
    later = CkptvaultCheckpointIO(store, run_id="r", delete_delay=0)
    later.save_checkpoint(_lightning_like(4), ckpt / "step=4.ckpt")
    later.remove_checkpoint(ckpt / "step=3.ckpt")  # 3 becomes the fallback: 1, 2 go
    assert [g.step for g in later.manager.generations(include_marked=True)] == [4, 3]
    later.teardown()


def test_pointers_are_read_as_hostile_input(tmp_path: Path):
    plugin = CkptvaultCheckpointIO(tmp_path / "store", run_id="r")
    plugin.save_checkpoint(_lightning_like(1), tmp_path / "good.ckpt")
    good = (tmp_path / "good.ckpt").read_bytes()
    cases = {
        "pickle.ckpt": b"\x80\x04\x95" + b"\0" * 40 + b".",  # a pickled .ckpt: never opened
        "zip.ckpt": b"PK\x03\x04" + b"\0" * 40,
        "huge.ckpt": b"{" + b" " * 10_000 + b"}",
        "fields.ckpt": good.replace(b'"run_id"', b'"run"'),
        "step.ckpt": good.replace(b'"step":1', b'"step":-1'),
        "id.ckpt": re.sub(rb'"generation_id":"[^"]+"', b'"generation_id":"../../etc"', good),
        "deep.ckpt": b"[" * 500 + b"]" * 500,
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(FormatError):
            plugin.load_checkpoint(tmp_path / name)
    os.mkfifo(tmp_path / "fifo.ckpt")  # a FIFO must not hang the trainer
    with pytest.raises(FormatError, match="not a regular file"):
        plugin.load_checkpoint(tmp_path / "fifo.ckpt")
    with pytest.raises(FileNotFoundError):
        plugin.load_checkpoint(tmp_path / "missing.ckpt")
    other = good.replace(b'"run_id":"r"', b'"run_id":"other"')
    (tmp_path / "other.ckpt").write_bytes(other)
    with pytest.raises(cv.errors.UsageError, match="run 'other'"):
        plugin.load_checkpoint(tmp_path / "other.ckpt")
    # Removing a file this plugin did not write leaves it (and the store) alone.
    plugin.remove_checkpoint(tmp_path / "pickle.ckpt")
    assert (tmp_path / "pickle.ckpt").exists()
    assert plugin.load_checkpoint(tmp_path / "good.ckpt")["global_step"] == 1
    plugin.teardown()


def test_load_checkpoint_moves_tensors_and_refuses_what_it_cannot_honour(tmp_path: Path):
    plugin = CkptvaultCheckpointIO(tmp_path / "store", run_id="r")
    plugin.save_checkpoint(_lightning_like(3), tmp_path / "a.ckpt")
    loaded = plugin.load_checkpoint(tmp_path / "a.ckpt", map_location="meta")
    assert all(t.device.type == "meta" for t in loaded["state_dict"].values())
    with pytest.raises(cv.errors.UsageError, match="map_location"):
        plugin.load_checkpoint(tmp_path / "a.ckpt", map_location=lambda storage, loc: storage)
    with pytest.raises(cv.errors.UsageError, match="storage_options"):
        plugin.save_checkpoint(_lightning_like(4), tmp_path / "b.ckpt", storage_options={})
    with pytest.raises(cv.errors.UsageError, match="global_step"):
        plugin.save_checkpoint({"weights": torch.ones(1)}, tmp_path / "c.ckpt")
    with pytest.raises(cv.errors.UsageError, match="async_save"):
        CkptvaultCheckpointIO(tmp_path / "store", async_save=True)
    plugin.teardown()


def test_ckptvault_imports_lightning_only_in_its_integration():
    """``import ckptvault`` and the CLI never load Lightning: only the integration's
    own modules import it (the plugin, its asynchronous wrapper, the policy's
    checkpoint callback and the multi-rank strategies; the pointer, pruning and per-rank modules do not)."""
    package = REPO / "src" / "ckptvault"
    importers = []
    for path in package.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            if any(
                n == "lightning" or n.startswith(("lightning.", "pytorch_lightning")) for n in names
            ):
                importers.append(str(path.relative_to(package)))
    assert sorted(set(importers)) == [
        "integrations/lightning.py",
        "integrations/lightning_async.py",
        "integrations/lightning_policy.py",
        "integrations/lightning_strategies.py",
    ]
