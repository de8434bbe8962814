"""The models and optimizers ``accelerator.prepare`` returned, as state entries, by
the engine that holds them.

- No engine (CPU, DDP, one GPU): each model unwrapped (``model``, ``model_1``, ...)
  and each optimizer's torch object (``optimizer``, ...): restored in place.
- FSDP (1 or 2): model ``i`` with optimizer ``i`` (as ``accelerator.save_state``
  pairs them) through DCP's state-dict API, every rank its shards
  (:mod:`ckptvault.engines.fsdp`).
- DeepSpeed (ZeRO 1-3): the one engine's fp32 weights, optimizer state and counters,
  every rank its chunk (:mod:`ckptvault.engines.deepspeed`): ``model``,
  ``optimizer`` and ``deepspeed``.

A restore fills the entries of :meth:`EngineEntries.entries` (``restoring=True``)
and then :meth:`EngineEntries.apply` loads what it wrote into the engine; when it
applies nothing, :meth:`EngineEntries.discard` leaves the engine as it was.
"""

from __future__ import annotations

from typing import Any

from ckptvault.engines.deepspeed import DeepSpeedState
from ckptvault.engines.fsdp import ShardedState
from ckptvault.errors import UsageError

__all__ = ["REFUSED", "EngineEntries"]

# Accelerate's distributed types that save through their own engines: refused.
REFUSED = frozenset({"MEGATRON_LM", "XLA"})


class EngineEntries:
    """The prepared models and optimizers of ``accelerator`` as state entries."""

    def __init__(self, accelerator: Any, engine: str) -> None:
        self.accelerator, self.engine = accelerator, engine
        self._pending: list[Any] = []  # engine states a restore is filling

    def names(self) -> list[str]:
        """The entry names :meth:`entries` uses."""
        models = [named("model", index) for index in range(len(self.accelerator._models))]
        count = len(self.accelerator._optimizers)
        optimizers = [named("optimizer", index) for index in range(count)]
        return [*models, *optimizers, *(["deepspeed"] if self.engine == "DEEPSPEED" else [])]

    def entries(self, restoring: bool) -> dict[str, Any]:
        """The entries to save, or (``restoring``) for a restore to fill."""
        if self.engine == "FSDP":
            return self._fsdp(restoring)
        if self.engine == "DEEPSPEED":
            return self._deepspeed(restoring)
        accelerator = self.accelerator
        entries: dict[str, Any] = {}
        for index, model in enumerate(accelerator._models):
            entries[named("model", index)] = accelerator.unwrap_model(model)
        for index, optimizer in enumerate(accelerator._optimizers):
            entries[named("optimizer", index)] = inner(optimizer)
        return entries

    def apply(self) -> None:
        """After a restore into :meth:`entries`: load what it wrote into the engine."""
        pending, self._pending = self._pending, []
        for state in pending:
            state.apply()

    def discard(self) -> None:
        """After a restore into :meth:`entries` that applied nothing (an empty store,
        or a refusal): the engines' optimizers as they were before (see
        ``DeepSpeedState.discard``)."""
        pending, self._pending = self._pending, []
        for state in pending:
            state.discard()

    def _fsdp(self, restoring: bool) -> dict[str, Any]:
        models, optimizers = self.accelerator._models, self.accelerator._optimizers
        if len(optimizers) > len(models):
            raise UsageError(
                f"{len(optimizers)} optimizers for {len(models)} FSDP models: the Checkpointer "
                "saves optimizer i with model i, as accelerator.save_state does"
            )
        self._pending = [
            ShardedState(model, inner(optimizers[index]) if index < len(optimizers) else None)
            for index, model in enumerate(models)
        ]
        entries: dict[str, Any] = {}
        for index, sharded in enumerate(self._pending):
            captured: dict[str, Any] = sharded.template() if restoring else sharded.capture()
            entries[named("model", index)] = captured["model"]
            if "optimizer" in captured:
                entries[named("optimizer", index)] = captured["optimizer"]
        return entries

    def _deepspeed(self, restoring: bool) -> dict[str, Any]:
        models = self.accelerator._models
        if len(models) != 1:
            raise UsageError(
                f"{len(models)} models prepared under DeepSpeed: the Checkpointer saves the one "
                "DeepSpeed engine Accelerate builds (prepare one model)"
            )
        state = DeepSpeedState(models[0])
        self._pending = [state]
        return dict(state.template() if restoring else state.capture())


def inner(optimizer: Any) -> Any:
    """The torch optimizer inside Accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def named(kind: str, index: int) -> str:
    return kind if index == 0 else f"{kind}_{index}"
