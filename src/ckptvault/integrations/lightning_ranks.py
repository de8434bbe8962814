"""A Lightning checkpoint of several ranks as one ckptvault generation.

Lightning builds its checkpoint dict on every rank, but its strategies hand only
rank 0's to the ``CheckpointIO``. That is not the job's whole state: each rank has
its own global RNGs (a module that puts ``torch.get_rng_state()`` into the dict puts
*its* rank's), its own data loader position, its own callback states. Restored from
rank 0's dict, rank 1 draws rank 0's dropout masks and the run is no longer the run
that was saved.

With ckptvault's strategies (:mod:`ckptvault.integrations.lightning_strategies`)
every rank saves, collectively, one generation holding:

- ``lightning``: rank 0's whole dict, exactly what a one-process save holds. Its
  ``state_dict`` and ``optimizer_states`` are the job's tensors, which every rank
  hands over: DDP's replicas (written once, and compared: ``on_replica_mismatch``),
  FSDP2's shards (DTensors, saved where they live and resharded on restore);
- ``lightning_rank``: each rank's own part, the rest of its dict (loops and their
  data loader states, callbacks, what ``on_save_checkpoint`` added), saved per rank
  (:class:`~ckptvault.state.ranks.PerRank`).

Loaded by as many ranks, each rank gets rank 0's dict with its own part put back
over it. Loaded by another number of ranks (a generation one process saved has no
per-rank part: it loads on any number), the per-rank parts mean nothing there: every
rank gets rank 0's, as Lightning's own checkpoints give, but for the data loaders'
positions, which index another split of the data (a position past the end of the
new split stops torchdata's loader with ``StopIteration``): the loaders start the
epoch again. A warning says so.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ckptvault.coordinator import Coordinator
from ckptvault.errors import CheckpointError
from ckptvault.state.ranks import PerRank

__all__ = ["JOB_KEYS", "OWN", "agree", "own_part", "put_back", "shared_part"]

logger = logging.getLogger("ckptvault")

# The job's tensors: replicated (DDP) or sharded (FSDP2) over the ranks.
JOB_KEYS = ("state_dict", "optimizer_states")
# The state entry of each rank's own part.
OWN = "lightning_rank"

T = TypeVar("T")


def shared_part(checkpoint: dict[str, Any], rank: int) -> dict[str, Any]:
    """What rank ``rank`` puts under ``lightning``: rank 0 its whole dict (the one the
    manifest keeps), the others their part of the job's tensors."""
    if rank == 0:
        return checkpoint
    return {key: checkpoint[key] for key in JOB_KEYS if key in checkpoint}


def own_part(checkpoint: Mapping[str, Any]) -> PerRank:
    """This rank's own part of its dict: everything but the job's tensors."""
    return PerRank({key: value for key, value in checkpoint.items() if key not in JOB_KEYS})


def put_back(
    checkpoint: dict[str, Any], own: Mapping[str, Any] | None, resharded: bool, where: str
) -> dict[str, Any]:
    """``checkpoint`` (rank 0's) with this rank's own part over it, in place. Saved by
    another number of ranks (``resharded``): rank 0's, without its data loader
    positions, said at WARNING."""
    if not resharded:
        checkpoint.update(own or {})  # keys keep their places: the order is rank 0's
        return checkpoint
    loops = checkpoint.get("loops")
    fit = loops.get("fit_loop") if isinstance(loops, dict) else None
    progress = fit.get("state_dict") if isinstance(fit, dict) else None
    if isinstance(progress, dict):
        progress.pop("combined_loader", None)
    logger.warning(
        "%s was saved by another number of ranks: every rank resumes with rank 0's loops, "
        "callback states and on_save_checkpoint values (each rank's own mean nothing "
        "here), and the data loaders start the epoch again",
        where,
    )
    return checkpoint


def agree(coordinator: Coordinator, what: str, action: Callable[[], T], error: type) -> T:
    """``action()`` on every rank, then whether it failed anywhere: a rank whose action
    raised re-raises it, the others raise ``error`` naming the first rank that failed
    (no rank goes on into a collective the failed one will never join)."""
    failure: BaseException | None = None
    result: Any = None
    try:
        result = action()
    except (CheckpointError, OSError) as exc:
        failure = exc
    if coordinator.world_size > 1:
        text = None if failure is None else f"{type(failure).__name__}: {failure}"[:2000]
        outcomes = coordinator.all_gather(text)
        failed = [(rank, str(text)[:2000]) for rank, text in enumerate(outcomes) if text]
        if failure is None and failed:
            rank, message = failed[0]
            raise error(f"rank {rank} could not {what}: {message}")
    if failure is not None:
        raise failure
    return result
