"""ckptvault inside existing ``torch.distributed.checkpoint`` code.

Swap two objects and plain DCP code (``dcp.save``, ``dcp.async_save``,
``dcp.load``; one process, or every rank of a torch.distributed job) gains
ckptvault's atomic publish, per-chunk BLAKE3 digests, optional Ed25519 signatures
and encryption, and verification before and while reading::

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import ckptvault as cv

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.save(state, storage_writer=cv.dcp.StorageWriter(url, run_id="r1", step=step))
    dcp.load(state, storage_reader=cv.dcp.StorageReader(url, run_id="r1"))
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])

Tensors (plain, DTensor, ShardedTensor) go into hashed tensor files; the state dict's
other values (an optimizer's ``param_groups``, counters, strings) are stored as JSON
in the generation, never pickled (:mod:`ckptvault.dcp.objects`), and a value JSON
cannot hold is refused before anything is published.

``dcp.save``/``dcp.load`` with these objects raise ckptvault's own errors
(``IntegrityError``, ``UsageError``, ``NoValidCheckpoint``, a storage ``OSError``...)
rather than DCP's ``CheckpointException`` (:mod:`ckptvault.dcp._typed`);
:func:`typed_errors` is kept for code that used it. Given ``ledger=``
(a path outside the store), the writer and the reader keep and check the manager's
own control plane: the writer records each publish in the ledger's published table
and the audit log; the reader applies the rollback floor, counts published
generations that vanished as failed candidates (``max_fallback``), refuses a step
older than a newer generation that verifies unless ``allow_rollback_to`` names it,
and raises the floor to what it read. Without ``ledger=`` the plugin reads and
writes no control-plane state: no floor, no rollback protection, no audit.

Between ranks, plain ``dcp.save``/``dcp.load``/``dcp.async_save`` on a process
group carry plans, write results and outcomes with DCP's own ``*_object``
collectives, which pickle: a dishonest rank of such a job can run code in rank 0.
That is DCP's path, taken by the calling code; these classes cannot change it.
:class:`ckptvault.CheckpointManager` never takes it (it drives DCP's planner over
bounded JSON collectives of its own: :mod:`ckptvault.distributed.dcp_save`), and
is the way to save when the ranks of a job do not trust each other.
"""

from __future__ import annotations

from ckptvault.dcp._typed import typed_errors
from ckptvault.dcp.reader import StorageReader
from ckptvault.dcp.writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter", "typed_errors"]
