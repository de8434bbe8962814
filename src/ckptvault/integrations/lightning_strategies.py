"""Lightning strategies of several ranks whose checkpoints every rank saves through
ckptvault, and that resume bit-identically.

::

    from ckptvault.integrations.lightning import CkptvaultCheckpointIO
    from ckptvault.integrations.lightning_strategies import CkptvaultDDPStrategy

    trainer = pl.Trainer(devices=2, strategy=CkptvaultDDPStrategy(),
                         plugins=[CkptvaultCheckpointIO("ckpt/run42", run_id="run42")], ...)

Lightning's strategies hand the ``CheckpointIO`` rank 0's dict alone (DDP), or write
sharded state themselves with ``torch.save`` and DCP, never calling it
(``ModelParallelStrategy``, ``FSDPStrategy`` with sharded state). These subclasses
call :class:`~ckptvault.integrations.lightning.CkptvaultCheckpointIO` on every rank
instead: one generation per save, each rank's own part in it
(:mod:`ckptvault.integrations.lightning_ranks`), published by rank 0 once every rank's
part is written, then the pointer.

- :class:`CkptvaultDDPStrategy`: the weights and optimizer state are DDP's replicas,
  written once (and compared between the ranks: ``on_replica_mismatch``).
- :class:`CkptvaultModelParallelStrategy` (FSDP2, ``configure_model`` with
  ``fully_shard``): weights and optimizer state are DTensors, each rank writes its
  shards and reads back its own, on the same or another number of ranks (2 -> 1:
  the state resharded, bit for bit). It saves shards only
  (``save_distributed_checkpoint=False`` is refused: ``ckptvault consolidate`` gives
  the whole model).

Both also mend the resumed data loader, which Lightning gets wrong with any
``CheckpointIO`` (:mod:`ckptvault.integrations.lightning_loaders`): its iterator is
made before the sampler's epoch is set, so a ``DistributedSampler`` replays epoch 0's
order, and a save after an epoch's last batch resumes an epoch late.

``FSDPStrategy`` (FSDP1) needs a GPU in this Lightning (``accelerator="cpu"`` is
refused, and FSDP1 itself refuses a CPU module when no device is given): it has no
subclass here yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from ckptvault.errors import UsageError
from ckptvault.integrations.lightning import CkptvaultCheckpointIO
from ckptvault.integrations.lightning_loaders import prepare_resumed_loader

__all__ = ["CkptvaultDDPStrategy", "CkptvaultModelParallelStrategy"]


class _EveryRankSaves:
    """What ckptvault's strategies share: save, load and remove through the plugin on
    every rank; a resumed loader mended."""

    def _ckptvault(self) -> CkptvaultCheckpointIO:
        plugin = self.checkpoint_io  # type: ignore[attr-defined]
        if not isinstance(plugin, CkptvaultCheckpointIO):
            raise UsageError(
                f"{type(self).__name__} saves through ckptvault: pass "
                "plugins=[CkptvaultCheckpointIO(store, run_id=...)] to the Trainer "
                f"(it has {type(plugin).__name__}; asynchronous saves are one rank's only)"
            )
        plugin.every_rank = True
        return plugin

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        self._ckptvault()  # no plugin: said before the fit starts, not at the first save

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        self._ckptvault().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> Any:
        plugin = self._ckptvault()
        checkpoint = plugin.load_checkpoint(checkpoint_path, into=self._restore_into())
        self._load_restored(checkpoint)
        return checkpoint

    def remove_checkpoint(self, filepath: _PATH) -> None:
        self._ckptvault().remove_checkpoint(filepath)  # rank 0 removes, the others return

    def process_dataloader(self, dataloader: Any) -> Any:
        """The loader, and when the fit resumes, mended to go on with the saved run's
        batches (:mod:`ckptvault.integrations.lightning_loaders`)."""
        dataloader = super().process_dataloader(dataloader)  # type: ignore[misc]
        module = self.lightning_module  # type: ignore[attr-defined]
        if module is not None:
            prepare_resumed_loader(module.trainer.fit_loop, dataloader)
        return dataloader

    def teardown(self) -> None:
        super().teardown()  # type: ignore[misc]
        plugin = self.checkpoint_io  # type: ignore[attr-defined]
        if isinstance(plugin, CkptvaultCheckpointIO):
            plugin.teardown()  # ModelParallelStrategy's teardown leaves it open

    def _restore_into(self) -> Mapping[str, Any] | None:
        """Entries of the checkpoint to restore in place (sharded): none by default,
        every rank gets the whole tensors."""
        return None

    def _load_restored(self, checkpoint: dict[str, Any]) -> None:
        """Load what Lightning will not (``load_model_state_dict`` is a no-op for
        sharded strategies): nothing by default."""


class CkptvaultDDPStrategy(_EveryRankSaves, DDPStrategy):
    """``DDPStrategy`` saving every rank's part through :class:`CkptvaultCheckpointIO`
    (see the module docstring). Takes ``DDPStrategy``'s arguments."""


class CkptvaultModelParallelStrategy(_EveryRankSaves, ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2, tensor parallelism) saving its DTensors
    through :class:`CkptvaultCheckpointIO`, collectively, and restoring them resharded
    (see the module docstring). Takes ``ModelParallelStrategy``'s arguments."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("save_distributed_checkpoint", True) is not True:
            raise UsageError(
                "CkptvaultModelParallelStrategy saves each rank's shards, which restore "
                "on any number of ranks; for one whole model file, run ckptvault "
                "consolidate on a generation (save_distributed_checkpoint=False is refused)"
            )
        super().__init__(*args, **kwargs)

    def _restore_into(self) -> Mapping[str, Any] | None:
        # The same form Lightning saves (sharded, CPU), as templates each rank fills
        # with its own shards; a fresh optimizer's state is initialised by DCP.
        into: dict[str, Any] = {"state_dict": self.lightning_module_state_dict()}
        if self._fitting():
            into["optimizer_states"] = [self.optimizer_state(opt) for opt in self.optimizers]
        return into

    def _load_restored(self, checkpoint: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        module = self.lightning_module
        assert self.model is not None and module is not None
        strict = module.strict_loading
        options = StateDictOptions(strict=strict)
        set_model_state_dict(self.model, checkpoint["state_dict"], options=options)
        if self._fitting():
            for optimizer, state in zip(
                self.optimizers, checkpoint["optimizer_states"], strict=True
            ):
                set_optimizer_state_dict(self.model, optimizer, state, options=options)

    def _fitting(self) -> bool:
        module = self.lightning_module
        return module is not None and module.trainer.state.fn == TrainerFn.FITTING
