"""What a checkpoint *path* given to an integration stands for: a hint, never trust.

Hugging Face's ``Trainer`` resumes from ``resume_from_checkpoint=".../checkpoint-N"``
(what ``get_last_checkpoint`` finds by listing the output directory). With ckptvault
the run's checkpoints are generations in the store, and whoever can write the output
directory can plant or rename a directory there. So once the run has history (the
store holds its generations, or the ledger knows it), a path is read for the step
its name gives and nothing else: ``checkpoint-N`` is ``restore(state, step=N)``,
under restore's rollback rule; any other path is refused. Before that, a path is
Trainer's own directory (moving a run over to ckptvault).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

from ckptvault.errors import UsageError

if TYPE_CHECKING:
    from ckptvault.manager import CheckpointManager

# Trainer's directory names (PREFIX_CHECKPOINT_DIR-<global step>).
CHECKPOINT_DIR = re.compile(r"checkpoint-([0-9]{1,18})")


def step_of_path(manager: CheckpointManager, path: str) -> int | str:
    """The step a ``resume_from_checkpoint`` path stands for, or the path itself when
    the run has no history yet (Trainer reads its own directory: moving a run over).
    With history a path is only a hint: whoever can write the output directory can
    plant or rename one, and Trainer would read it unverified."""
    if not has_history(manager):
        return path
    found = CHECKPOINT_DIR.fullmatch(Path(path).name)
    if found is None:
        raise UsageError(
            f"resume_from_checkpoint={path!r}: run {manager.run_id!r} has generations in "
            f"{manager.store.location}, and a directory outside it would resume the run "
            "unverified. Resume with resume_from_checkpoint=True (the newest that "
            "verifies) or a step number"
        )
    return int(found.group(1))


def has_history(manager: CheckpointManager) -> bool:
    """Whether the run has history, so that ``restore(state)`` would not start over
    (it returns None only when this holds): a generation in any tier restore reads (the
    store, and the replica with ``replicate_to``; marked ones too), or a restore or
    publish the ledger knows of. Never "no generation that is not marked": marks
    planted on every generation, or a local tier emptied beside a full replica, must
    not make a resume a silent fresh start (restore ignores marks the ledger did not
    record, refuses a store where every generation is marked, reads the replica)."""
    if manager.generations(include_marked=True):
        return True
    replicator = manager.replicator
    if replicator is not None and replicator.target.list_generations():
        return True
    floor = manager.trust.floor(manager.run_id)
    return bool(manager.trust.published(manager.run_id)) or (
        floor is not None and floor.step is not None
    )
