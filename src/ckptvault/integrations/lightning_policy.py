"""PyTorch Lightning: train-step saves decided by a ckptvault save policy.

::

    trainer = pl.Trainer(
        plugins=[CkptvaultCheckpointIO("ckpt/run42", run_id="run42",
                                       save_policy=cv.Planned(mtbf_hours=50_000, nodes=8))],
        callbacks=[PolicyCheckpoint(dirpath="runs/run42", save_last=True)])

``ModelCheckpoint`` decides by ``every_n_train_steps`` or ``train_time_interval``
(its time rule is agreed with ``strategy.broadcast``, which pickles). A
:class:`PolicyCheckpoint` is a ``ModelCheckpoint`` whose train-step saves follow the
plugin's ``save_policy=`` instead: after every training batch it asks the plugin's
manager ``should_save(global_step)`` (on every rank; time rules agreed through
ckptvault's coordinator as JSON) and saves its top-k and ``last`` checkpoints when the
answer is yes. A ``save_on_signal`` signal makes the answer yes, and that save is the
final one (the manager raises ``Preempted`` from it). Everything else is
``ModelCheckpoint``'s: file names, ``save_top_k``, ``save_last``, ``ckpt_path="last"``;
saves at epoch ends are off unless ``every_n_epochs`` asks for them.

On several ranks the plugin must save on every rank (ckptvault's strategies,
:mod:`ckptvault.integrations.lightning_strategies`): under Lightning's own strategies
each rank's manager is a process of its own, and their clocks would disagree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from ckptvault.errors import UsageError
from ckptvault.integrations.lightning import CkptvaultCheckpointIO

if TYPE_CHECKING:
    import lightning.pytorch as pl

    from ckptvault.manager import CheckpointManager

__all__ = ["PolicyCheckpoint"]

_DECIDED_BY_POLICY = ("every_n_train_steps", "train_time_interval")


class PolicyCheckpoint(ModelCheckpoint):
    """A ``ModelCheckpoint`` that saves when the ckptvault plugin's ``save_policy``
    says so; takes ``ModelCheckpoint``'s arguments except ``every_n_train_steps`` and
    ``train_time_interval`` (the policy decides); ``every_n_epochs`` defaults to 0."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = [name for name in _DECIDED_BY_POLICY if kwargs.get(name) is not None]
        if given:
            raise UsageError(
                f"PolicyCheckpoint does not take {', '.join(given)}: the save policy "
                "decides when to save; give it to the plugin, e.g. CkptvaultCheckpointIO"
                "(store, save_policy=cv.Every(steps=500))"
            )
        kwargs.setdefault("every_n_epochs", 0)
        super().__init__(*args, **kwargs)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if (
            getattr(trainer, "fast_dev_run", False)
            or trainer.sanity_checking
            or trainer.state.fn != TrainerFn.FITTING
        ):
            return  # as ModelCheckpoint: nothing saved outside a real fit
        # Every rank asks, every batch: a time rule's answer is a collective.
        if not _manager(trainer).should_save(trainer.global_step):
            return
        if self._should_skip_saving_checkpoint(trainer):  # this step is saved already
            return
        candidates = self._monitor_candidates(trainer)
        self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)


def _manager(trainer: pl.Trainer) -> CheckpointManager:
    """The plugin's manager, which holds the policy; ``UsageError`` where it cannot
    decide for the whole job."""
    plugin = trainer.strategy.checkpoint_io
    if not isinstance(plugin, CkptvaultCheckpointIO):
        raise UsageError(
            "PolicyCheckpoint follows the save policy of ckptvault's plugin: pass "
            "plugins=[CkptvaultCheckpointIO(store, save_policy=cv.Every(steps=500))] to the "
            f"Trainer (it has {type(plugin).__name__})"
        )
    if trainer.world_size > 1 and not plugin.every_rank:
        raise UsageError(
            "PolicyCheckpoint on several ranks needs every rank to save through the plugin, "
            "so that the ranks agree on each save: use ckptvault's strategies, e.g. "
            "strategy=CkptvaultDDPStrategy() (ckptvault.integrations.lightning_strategies)"
        )
    manager = plugin.manager
    if manager.save_policy is None:
        raise UsageError(
            "PolicyCheckpoint needs a save policy on the plugin: "
            "CkptvaultCheckpointIO(store, save_policy=cv.Every(steps=500)) (or cv.Every("
            "seconds=...), cv.Planned(...), cv.Any(...))"
        )
    return manager
