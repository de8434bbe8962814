"""Asynchronous Lightning saves through ckptvault: Lightning's ``AsyncCheckpointIO``
around :class:`~ckptvault.integrations.lightning.CkptvaultCheckpointIO`, with
removals kept in order.

``AsyncCheckpointIO`` clones the checkpoint's tensors and saves in one background
thread, but runs ``remove_checkpoint`` at once on the training thread. With
``save_top_k``, Lightning removes the previous checkpoint right after it asks for the
next one; a removal that overtakes the save of the file it removes finds nothing,
and the save then writes the pointer afterwards: a stale pointer in the checkpoint
directory and a generation never released (seen: ``epoch=1-step=10.ckpt`` left behind
by a 30-step fit with ``save_top_k=1``). Here removals are queued behind the saves
in flight, on the same thread, so each happens after the save it follows::

    from ckptvault.integrations.lightning_async import AsyncCkptvaultCheckpointIO
    trainer = pl.Trainer(plugins=[AsyncCkptvaultCheckpointIO("runs/store", run_id="r")])

Errors of either surface at the next save or removal, or at teardown, as
``AsyncCheckpointIO`` reports them.
"""

from __future__ import annotations

from typing import Any

from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import AsyncCheckpointIO

from ckptvault.integrations.lightning import CkptvaultCheckpointIO

__all__ = ["AsyncCkptvaultCheckpointIO"]


class AsyncCkptvaultCheckpointIO(AsyncCheckpointIO):
    """``AsyncCheckpointIO(CkptvaultCheckpointIO(store, **options))``, removals in
    order with the saves (see the module docstring). ``plugin``: the inner plugin
    (its ``manager``, ``restore_info``)."""

    def __init__(self, store: Any, **options: Any) -> None:
        self.plugin = CkptvaultCheckpointIO(store, **options)
        super().__init__(self.plugin)

    def remove_checkpoint(self, path: _PATH) -> None:
        """Queue the removal behind the saves in flight (none: remove now)."""
        self._ensure_setup()
        assert self._executor is not None

        def remove() -> None:
            try:
                self.plugin.remove_checkpoint(path)
            except BaseException as exc:  # reported as AsyncCheckpointIO reports saves
                self._error = exc

        self._executor.submit(remove)
        if self._error:
            raise self._error

    def teardown(self) -> None:
        """Wait for the saves and removals in flight, then close the inner plugin's
        manager (``AsyncCheckpointIO`` alone leaves it open, holding the store)."""
        try:
            super().teardown()
        finally:
            self.plugin.teardown()
