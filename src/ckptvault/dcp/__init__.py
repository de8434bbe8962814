"""ckptvault inside existing ``torch.distributed.checkpoint`` code.

Swap two objects and plain DCP code (``dcp.save``, ``dcp.async_save``,
``dcp.load``; one process, or every rank of a torch.distributed job) gains
ckptvault's atomic publish, per-chunk BLAKE3 digests, optional Ed25519 signatures
and encryption, and verification before and while reading::

    import torch.distributed.checkpoint as dcp
    import ckptvault as cv

    dcp.save(state_dict, storage_writer=cv.dcp.StorageWriter(url, run_id="r1", step=step))
    dcp.load(state_dict, storage_reader=cv.dcp.StorageReader(url, run_id="r1"))

Only tensors (plain, DTensor, ShardedTensor) are stored: values DCP would pickle
are refused before anything is written. Non-tensor state (counters, RNG, data
loaders, optimizer hyperparameters) belongs to
:class:`ckptvault.CheckpointManager`, whose state capture stores it as JSON.

DCP reports failures inside its ``CheckpointException``;
:func:`typed_errors` re-raises ckptvault's own error instead. The rollback floor,
ledger and audit log are the manager's; the plugin neither reads nor writes them.
"""

from __future__ import annotations

from ckptvault.dcp._common import typed_errors
from ckptvault.dcp.reader import StorageReader
from ckptvault.dcp.writer import StorageWriter

__all__ = ["StorageReader", "StorageWriter", "typed_errors"]
