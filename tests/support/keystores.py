"""Key stores that hold a save back at a chosen moment, for tests of asynchronous saves."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

import ckptvault as cv
from ckptvault.errors import KeyUnavailableError
from ckptvault.trust.keystore import LocalKeyStore


class ControlledKeyStore(LocalKeyStore):
    """A real key store whose wrapping can be held up or made to fail (a slow or
    unreachable KMS), to steer background saves."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory)
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False

    def wrap(self, run_id: str, data_key: bytes, context: bytes) -> tuple[str, bytes]:
        assert self.gate.wait(timeout=60)
        if self.fail:
            raise KeyUnavailableError("the KMS is unreachable")
        return super().wrap(run_id, data_key, context)


def failing_manager(store: Path, tmp_path: Path) -> tuple[cv.CheckpointManager, ControlledKeyStore]:
    keys = ControlledKeyStore(tmp_path / "keys")
    mgr = cv.CheckpointManager(store, run_id="r", keystore=keys, async_save=True)
    mgr.save(1, {"x": torch.ones(10)}).result()  # one good generation first
    keys.fail = True
    return mgr, keys

