"""A pointer directory decides no deletion (issue 23, item 5).

``ModelCheckpoint``'s directory holds the plugin's pointers; whoever can write it,
but not the store, could before this change steer the plugin's pruning: rewrite a
pointer Lightning is about to remove so that it names a genuine generation it keeps
(the best, say) and delete that generation's own pointer, or plant the directory's
journal of released generations. The plugin then deleted the genuine generation from
the store. Now what the plugin put at each path, and what Lightning let go of, are
records in the run's store; the files in the directory are hints for loading only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning.pytorch")
from ckptvault.integrations.lightning import CkptvaultCheckpointIO


def lightning_like(step: int) -> dict[str, Any]:
    return {
        "epoch": 0,
        "global_step": step,
        "pytorch-lightning_version": "2",
        "state_dict": {"w": torch.full((4,), float(step))},
    }


def steps(plugin: CkptvaultCheckpointIO) -> list[int]:
    return sorted(g.step for g in plugin.manager.generations(include_marked=True))


def saved(tmp_path: Path, upto: int) -> tuple[CkptvaultCheckpointIO, Path]:
    store, ckpt = tmp_path / "store", tmp_path / "ckpt"
    plugin = CkptvaultCheckpointIO(store, run_id="r", delete_delay=0)
    for step in range(1, upto + 1):
        plugin.save_checkpoint(lightning_like(step), ckpt / f"step={step}.ckpt")
    return plugin, ckpt


def test_a_rewritten_pointer_releases_what_the_plugin_put_there(tmp_path: Path):
    """Step 1 is Lightning's best: its pointer stays. The attacker copies it over
    step=3.ckpt, which Lightning removes next, and deletes step=1.ckpt. Lightning's
    removal releases generation 3 (what the plugin wrote there), never 1."""
    plugin, ckpt = saved(tmp_path, 5)
    shutil.copyfile(ckpt / "step=1.ckpt", ckpt / "step=3.ckpt")
    (ckpt / "step=1.ckpt").unlink()
    plugin.remove_checkpoint(ckpt / "step=3.ckpt")
    plugin.remove_checkpoint(ckpt / "step=2.ckpt")
    assert steps(plugin) == [1, 4, 5]  # 2 and 3 went; 4 is the fallback, 5 the newest
    plugin.teardown()


def test_a_planted_journal_releases_nothing(tmp_path: Path):
    """The next process finds a journal of released generations naming step 1 (and
    step 1's pointer gone): nothing is pruned for it."""
    plugin, ckpt = saved(tmp_path, 4)
    pointer = json.loads((ckpt / "step=1.ckpt").read_bytes())
    plugin.teardown()
    (ckpt / "step=1.ckpt").unlink()
    journal = {
        "ckptvault_lightning_released": 1,
        "generations": [[1, pointer["generation_id"]]],
    }
    (ckpt / ".ckptvault-released.json").write_text(json.dumps(journal))
    later = CkptvaultCheckpointIO(tmp_path / "store", run_id="r", delete_delay=0)
    later.save_checkpoint(lightning_like(5), ckpt / "step=5.ckpt")
    later.remove_checkpoint(ckpt / "step=4.ckpt")  # a real release: prunes run
    assert steps(later) == [1, 2, 3, 4, 5]  # 4 is the fallback now; 1 stays
    later.teardown()


def test_an_overwritten_pointer_from_an_earlier_process_still_releases(tmp_path: Path):
    """What an earlier process put at last.ckpt is in the store's records: overwriting
    it in a later process releases that generation, as Lightning meant."""
    store, ckpt = tmp_path / "store", tmp_path / "ckpt"
    first = CkptvaultCheckpointIO(store, run_id="r", delete_delay=0)
    for step in (1, 2, 3):
        first.save_checkpoint(lightning_like(step), ckpt / "last.ckpt")
    assert steps(first) == [2, 3]  # 1 released and gone; 2 the fallback
    first.teardown()
    later = CkptvaultCheckpointIO(store, run_id="r", delete_delay=0)
    later.save_checkpoint(lightning_like(4), ckpt / "last.ckpt")
    assert steps(later) == [3, 4]  # 2 was released at once; 3 released now, kept as fallback
    later.save_checkpoint(lightning_like(5), ckpt / "last.ckpt")
    assert steps(later) == [4, 5]
    later.teardown()
