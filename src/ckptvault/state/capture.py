"""Capture: the user's state dict -> tensors plus a JSON tree (and back).

The state dict may hold, at any depth inside plain dicts, lists and tuples:

- objects with ``state_dict()``/``load_state_dict()`` (modules, optimizers, LR
  schedulers, GradScaler, data loaders, ...) -> ``{"$stateful": {...}}``
- :class:`~ckptvault.state.rng.RNGState` -> ``{"$rng": ...}``
- ``numpy.random.Generator`` -> ``{"$np_generator": ...}``
- ``torch.Generator`` -> ``{"$torch_generator": ...}``
- tensors and plain values, through :mod:`ckptvault.state.codec`.

Every tensor becomes one entry of a flat ``{key: tensor}`` dict that goes through
torch.distributed.checkpoint; its key is its escaped key path (for example
``optimizer/state/0/exp_avg``). Capture never copies tensor data and never draws
from any RNG.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptvault.errors import FormatError, UnsupportedValueError, UsageError
from ckptvault.state.codec import Decoder, Encoder, KeyPath, format_path, tensor_key
from ckptvault.state.rng import RNGState

MODULE = "module"
OPTIMIZER = "optimizer"
LR_SCHEDULER = "lr_scheduler"
GRAD_SCALER = "grad_scaler"
STATEFUL = "stateful"


def is_stateful(value: Any) -> bool:
    return (
        not isinstance(value, type)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def stateful_kind(value: Any) -> str:
    if isinstance(value, torch.nn.Module):
        return MODULE
    if isinstance(value, torch.optim.Optimizer):
        return OPTIMIZER
    schedulers = (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    if isinstance(value, schedulers):
        return LR_SCHEDULER
    if isinstance(value, torch.amp.GradScaler):
        return GRAD_SCALER
    return STATEFUL


def type_name(value: Any) -> str:
    kind = type(value)
    return f"{kind.__module__}.{kind.__qualname__}"


@dataclass
class CapturedState:
    """A state dict split into its tensors and a JSON tree that references them."""

    tree: dict[str, Any]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class _TensorCollector:
    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._paths: dict[str, KeyPath] = {}

    def __call__(self, path: KeyPath, tensor: torch.Tensor) -> str:
        key = tensor_key(path)
        if key in self.tensors:
            raise UnsupportedValueError(
                format_path(path),
                tensor,
                f"its flat name {key!r} collides with {format_path(self._paths[key])}; "
                "rename one of the keys",
            )
        self.tensors[key] = tensor.detach()
        self._paths[key] = path
        return key


class _StateEncoder(Encoder):
    """Encodes the user's state: stateful objects and generators get their own tags."""

    def __init__(self, collector: _TensorCollector) -> None:
        super().__init__(collector)
        self._plain = Encoder(collector)

    def encode_special(self, value: Any, path: KeyPath) -> Any:
        if isinstance(value, RNGState):
            return {"$rng": self._plain.encode(value.state_dict(), path)}
        if isinstance(value, np.random.Generator):
            return {"$np_generator": self._plain.encode(value.bit_generator.state, path)}
        if isinstance(value, torch.Generator):
            return {
                "$torch_generator": {
                    "device": str(value.device),
                    "state": self._plain.encode(value.get_state(), (*path, "state")),
                }
            }
        if isinstance(value, torch.Tensor) or not is_stateful(value):
            return NotImplemented
        state = value.state_dict()
        if not isinstance(state, Mapping):
            raise UnsupportedValueError(
                format_path(path), state, f"{type_name(value)}.state_dict() must return a dict"
            )
        payload: dict[str, Any] = {
            "kind": stateful_kind(value),
            "type": type_name(value),
            "state": self._plain.encode(dict(state), path),
        }
        metadata = getattr(state, "_metadata", None)
        if payload["kind"] == MODULE and metadata is not None:
            # Per-submodule versions that load_state_dict hands to _load_from_state_dict.
            payload["module_metadata"] = self._plain.encode(metadata, (*path, "_metadata"))
        return {"$stateful": payload}


def capture_state(state: Mapping[str, Any]) -> CapturedState:
    """Split ``state`` into tensors and a JSON tree; raises on unsupported values."""
    if not isinstance(state, Mapping):
        raise UsageError(f"state must be a dict of named entries, not {type(state).__name__}")
    collector = _TensorCollector()
    encoder = _StateEncoder(collector)
    tree = {}
    for key, value in state.items():
        if type(key) is not str:
            raise UnsupportedValueError(f"state key {key!r}", key, "top-level keys must be str")
        tree[key] = encoder.encode(value, (key,))
    return CapturedState(tree=tree, tensors=collector.tensors)


# -- decoding: placeholders that restore matches against live objects ---------------


@dataclass
class StatefulPayload:
    kind: str
    type_name: str
    state: dict[str, Any]
    module_metadata: Any = None


@dataclass
class RngPayload:
    state: dict[str, Any]


@dataclass
class NumpyGeneratorPayload:
    state: dict[str, Any]


@dataclass
class TorchGeneratorPayload:
    device: str
    state: torch.Tensor


class _StateDecoder(Decoder):
    def __init__(self, tensors: Mapping[str, torch.Tensor], where: str) -> None:
        super().__init__(tensors, where)
        self._plain = Decoder(tensors, where)

    def decode_special(self, tag: str, payload: Any, path: KeyPath) -> Any:
        try:
            if tag == "$stateful":
                return StatefulPayload(
                    kind=payload["kind"],
                    type_name=payload["type"],
                    state=self._plain.decode(payload["state"], path),
                    module_metadata=self._plain.decode(payload.get("module_metadata"), path),
                )
            if tag == "$rng":
                return RngPayload(self._plain.decode(payload, path))
            if tag == "$np_generator":
                return NumpyGeneratorPayload(self._plain.decode(payload, path))
            if tag == "$torch_generator":
                return TorchGeneratorPayload(
                    device=payload["device"],
                    state=self._plain.decode(payload["state"], (*path, "state")),
                )
        except (KeyError, TypeError) as exc:
            raise self.fail(path, f"malformed {tag} entry ({exc!r})") from exc
        return NotImplemented


def decode_tree(
    tree: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], where: str
) -> dict[str, Any]:
    """Rebuild the saved state with placeholders for objects restored in place."""
    if not isinstance(tree, Mapping):
        raise FormatError(f"{where}: the state tree is not an object")
    decoder = _StateDecoder(tensors, where)
    return {key: decoder.decode(value, (key,)) for key, value in tree.items()}
