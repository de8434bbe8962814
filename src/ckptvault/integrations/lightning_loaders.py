"""A resumed Lightning data loader that goes on with the saved run's batches.

Lightning restores a stateful loader (torchdata's ``StatefulDataLoader``) by loading
its state and making its iterator, which fast-forwards to the saved position, before
the epoch starts: with any ``CheckpointIO``, on one rank or several. Two things go
wrong there that the data of a run never stopped does not show:

- The iterator is made before Lightning calls the sampler's ``set_epoch``. A sampler
  whose order is computed when its iterator is made (Lightning's own
  ``DistributedSampler`` on several ranks, ``torch.randperm(n, generator=seed+epoch)``)
  then gives the order of the epoch it had, 0 in a fresh process: the batches after
  the saved position come from epoch 0's order. Here the restored epoch is set first.
- Saved after the last batch of an epoch (``every_n_train_steps`` landing there),
  the loader's state is at the end of its epoch but not finished (the iterator had
  not yet been asked for a batch past the end), while Lightning's restored loops
  count the epoch done. The resumed fit then spends its next epoch on the empty rest
  of the old iterator and trains on the order of the epoch after. Here that state is
  marked finished, so the loader begins the next epoch, whose ``set_epoch`` it got.

One order no checkpoint holds: a loader's own ``shuffle=True`` on several ranks
(torchdata's ``RandomSampler``), which Lightning wraps in a
``DistributedSamplerWrapper`` that draws a new order from the sampler's generator at
every epoch. A resume from it is warned about; leave shuffling to Lightning (a loader
without ``shuffle`` or ``sampler``) or give a sampler whose order follows ``set_epoch``.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["prepare_resumed_loader"]

logger = logging.getLogger("ckptvault")

# torchdata's StatefulDataLoader state: whether its iterator had ended.
FINISHED = "_iterator_finished"


def prepare_resumed_loader(fit_loop: Any, dataloader: Any) -> None:
    """Make ``dataloader`` (a training loader Lightning has just set up, its saved
    state not loaded yet) resume the saved run's batches; nothing when the fit does
    not resume."""
    if not fit_loop.restarting:
        return
    states = getattr(fit_loop, "_combined_loader_states_to_load", None)
    if states:
        progress = fit_loop.epoch_progress.current
        # After the epoch's last batch and before its end: Lightning counts it done.
        ended = fit_loop.epoch_loop.batch_progress.is_last_batch and (
            progress.processed == progress.completed
        )
        set_epoch(dataloader, progress.processed + 1 if ended else progress.processed)
        if ended:
            for state in states:
                if isinstance(state, dict) and FINISHED in state:
                    state[FINISHED] = True
    if _order_from_unsaved_draws(dataloader):
        logger.warning(
            "resuming a loader whose order Lightning draws anew each epoch from its "
            "sampler's generator (shuffle=True, wrapped in a DistributedSamplerWrapper), "
            "which no checkpoint holds: the batches from here on are not the saved run's. "
            "Leave shuffling to Lightning (no shuffle= or sampler=) for an exact resume"
        )


def set_epoch(dataloader: Any, epoch: int) -> None:
    """``set_epoch(epoch)`` on the loader's sampler and its batch sampler's sampler,
    once each, as Lightning does at the start of an epoch."""
    seen: set[int] = set()
    for sampler in _samplers(dataloader):
        if id(sampler) not in seen and callable(getattr(sampler, "set_epoch", None)):
            seen.add(id(sampler))
            sampler.set_epoch(epoch)


def _samplers(dataloader: Any) -> list[Any]:
    batches = getattr(dataloader, "batch_sampler", None)
    found = (getattr(dataloader, "sampler", None), getattr(batches, "sampler", None))
    return [sampler for sampler in found if sampler is not None]


def _order_from_unsaved_draws(dataloader: Any) -> bool:
    """Whether Lightning wrapped a random sampler (``shuffle=True``) in its
    ``DistributedSamplerWrapper``: each epoch's order is a new draw from its generator."""
    for sampler in _samplers(dataloader):
        if type(sampler).__name__ == "DistributedSamplerWrapper":
            inner = getattr(getattr(sampler, "dataset", None), "_sampler", None)
            if type(inner).__name__ == "RandomSampler":  # torch's or torchdata's
                return True
    return False
