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
``optimizer/state/fc1.weight/exp_avg``: optimizer state by parameter name where the
state's modules name every parameter, :mod:`ckptvault.state.param_names`). Capture
never copies tensor data and never draws from any RNG.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptvault.errors import FormatError, UnsupportedValueError, UsageError
from ckptvault.state.codec import (
    Decoder,
    Encoder,
    KeyPath,
    format_path,
    parse_device,
    tensor_key,
)
from ckptvault.state.names import plain_name
from ckptvault.state.param_names import by_name, parameter_names
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
    # A multi-rank save: this rank's own entries (``ckptvault.state.ranks``); the
    # tree then holds the job's entries only.
    rank_tree: dict[str, Any] | None = None


def _identity(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """What makes two tensors one (a tied embedding and LM head): the same memory
    seen the same way. None where that cannot be told cheaply (sharded DTensors,
    meta or empty tensors): those are always written apart."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.numel() == 0:
        return None
    if tensor.is_meta:
        return None
    # data_ptr() is the storage's address plus the offset in bytes: with the dtype
    # and the device it tells the same as (storage address, storage offset). The
    # conjugate and negative bits are part of how the memory is seen: ``z.conj()``
    # shares everything else with ``z`` and holds other values. The shape as a plain
    # tuple: then the key holds nothing Python's collector tracks (a torch.Size it
    # does), and 10,000 keys are not walked again by every full collection.
    return (
        tensor.data_ptr(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
        tensor.device,
        tensor.is_conj(),
        tensor.is_neg(),
    )


class _TensorCollector:
    """Names each tensor of the state by its key path; a tensor met again under
    another path (tied weights) is written once, the tree referring to it twice."""

    def __init__(self) -> None:
        self.tensors: dict[str, torch.Tensor] = {}
        self._paths: dict[str, KeyPath] = {}
        self._by_identity: dict[tuple[Any, ...], str] = {}

    def __call__(self, path: KeyPath, tensor: torch.Tensor) -> str:
        key = tensor_key(path)
        if key in self.tensors:
            raise UnsupportedValueError(
                format_path(path),
                tensor,
                f"its flat name {key!r} collides with {format_path(self._paths[key])}; "
                "rename one of the keys",
            )
        identity = _identity(tensor)
        if identity is not None and identity in self._by_identity:
            return self._by_identity[identity]
        self.tensors[key] = tensor.detach() if tensor.requires_grad else tensor
        self._paths[key] = path
        if identity is not None:
            self._by_identity[identity] = key
        return key


class _StateEncoder(Encoder):
    """Encodes the user's state: stateful objects and generators get their own tags."""

    def __init__(self, collector: _TensorCollector) -> None:
        super().__init__(collector)
        self._plain = Encoder(collector)
        self.names: dict[int, str] = {}  # id(parameter) -> name (state.param_names)

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
        kind = stateful_kind(value)
        plain = _plain_names(state, path) if kind == MODULE else dict(state)
        if kind == OPTIMIZER:  # by parameter name where the state's modules name them
            plain = by_name(value, self.names, state) or plain
        payload: dict[str, Any] = {
            "kind": kind,
            "type": type_name(value),
            "state": self._plain.encode(plain, path),
        }
        metadata = getattr(state, "_metadata", None)
        if kind == MODULE and metadata is not None:
            # Later (deeper) prefixes win: a compiled root's "" and "_orig_mod" are one.
            metadata = {plain_name(prefix): versions for prefix, versions in metadata.items()}
        if payload["kind"] == MODULE and metadata is not None:
            # Per-submodule versions that load_state_dict hands to _load_from_state_dict.
            payload["module_metadata"] = self._plain.encode(metadata, (*path, "_metadata"))
        return {"$stateful": payload}


def _plain_names(state: Mapping[str, Any], path: KeyPath) -> dict[str, Any]:
    """A module's state under the plain names (no ``_orig_mod.``), so checkpoints
    of compiled and plain models are interchangeable (:mod:`ckptvault.state.names`)."""
    plain: dict[str, Any] = {}
    for key, value in state.items():
        name = plain_name(key) if isinstance(key, str) else key
        if name in plain:
            raise UnsupportedValueError(
                format_path((*path, key)),
                key,
                f"two keys of the module's state_dict() have the plain name {name!r}",
            )
        plain[name] = value
    return plain


def capture_state(
    state: Mapping[str, Any], names: Mapping[int, str] | None = None
) -> CapturedState:
    """Split ``state`` into tensors and a JSON tree; raises on unsupported values.
    ``names``: parameter names for optimizer state (default: ``state``'s own modules,
    :func:`ckptvault.state.param_names.parameter_names`)."""
    if not isinstance(state, Mapping):
        raise UsageError(f"state must be a dict of named entries, not {type(state).__name__}")
    collector = _TensorCollector()
    encoder = _StateEncoder(collector)
    encoder.names = dict(names) if names is not None else parameter_names(state)
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


_KINDS = frozenset({MODULE, OPTIMIZER, LR_SCHEDULER, GRAD_SCALER, STATEFUL})
_STATEFUL_REQUIRED = frozenset({"kind", "type", "state"})
_STATEFUL_KEYS = _STATEFUL_REQUIRED | {"module_metadata"}
_RNG_REQUIRED = frozenset({"python", "numpy", "torch_cpu"})
_RNG_KEYS = _RNG_REQUIRED | {"cuda"}
_MAX_TYPE_NAME = 512
# Module metadata entries torch writes: {"version": n}. ``assign_to_params_buffers``
# is torch's own load-time flag (it replaces parameters instead of copying into them):
# a checkpoint never sets it.
_FORBIDDEN_METADATA = frozenset({"assign_to_params_buffers"})


def _is_rng_state_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.uint8 and value.dim() == 1


class _StateDecoder(Decoder):
    """Decodes the tags of :class:`_StateEncoder`, checking each payload's type and
    shape as strictly as the encoder writes it: the store may hold anything, and a
    payload that is not what a save writes is a :class:`FormatError` (the generation
    is skipped), never a raw error later, in planning or while applying."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], where: str) -> None:
        super().__init__(tensors, where)
        self._plain = Decoder(tensors, where)

    def decode_special(self, tag: str, payload: Any, path: KeyPath) -> Any:
        if tag == "$stateful":
            return self._stateful(payload, path)
        if tag == "$rng":
            return RngPayload(self._rng_state(payload, path))
        if tag == "$np_generator":
            state = self._plain.decode(payload, path)
            if not isinstance(state, dict) or type(state.get("bit_generator")) is not str:
                raise self.fail(path, "$np_generator must hold a bit generator's state dict")
            return NumpyGeneratorPayload(state)
        if tag == "$torch_generator":
            if type(payload) is not dict or set(payload) != {"device", "state"}:
                raise self.fail(path, "$torch_generator must hold exactly device and state")
            if parse_device(payload["device"]) is None:
                raise self.fail(path, f"not a device name: {str(payload['device'])[:64]!r}")
            state = self._plain.decode(payload["state"], (*path, "state"))
            if not _is_rng_state_tensor(state):
                raise self.fail(path, "a torch.Generator state must be a 1-d uint8 tensor")
            return TorchGeneratorPayload(device=payload["device"], state=state)
        return NotImplemented

    def _stateful(self, payload: Any, path: KeyPath) -> StatefulPayload:
        if (
            type(payload) is not dict
            or not set(payload) >= _STATEFUL_REQUIRED
            or not set(payload) <= _STATEFUL_KEYS
        ):
            raise self.fail(path, "$stateful must hold kind, type, state (and module_metadata)")
        kind, name = payload["kind"], payload["type"]
        if type(kind) is not str or kind not in _KINDS:
            raise self.fail(path, f"unknown stateful kind {str(kind)[:64]!r}")
        if type(name) is not str or len(name) > _MAX_TYPE_NAME:
            raise self.fail(path, "$stateful type must be a class name")
        state = self._plain.decode(payload["state"], path)
        if not isinstance(state, dict):
            raise self.fail(path, f"{kind} state must be a dict, not {type(state).__name__}")
        metadata = None
        if kind == MODULE:
            if not all(type(key) is str for key in state):
                raise self.fail(path, "a module's state keys must be strings")
            metadata = self._module_metadata(payload.get("module_metadata"), path)
        elif payload.get("module_metadata") is not None:
            raise self.fail(path, f"a {kind} has no module_metadata")
        return StatefulPayload(kind=kind, type_name=name, state=state, module_metadata=metadata)

    def _module_metadata(self, raw: Any, path: KeyPath) -> Any:
        """``state_dict()._metadata``: submodule prefix -> {"version": n}."""
        where = (*path, "_metadata")
        metadata = self._plain.decode(raw, where)
        if metadata is None:
            return None
        if not isinstance(metadata, dict):
            raise self.fail(where, "module metadata must be a dict")
        for prefix, entry in metadata.items():
            if type(prefix) is not str or not isinstance(entry, dict):
                raise self.fail(where, "module metadata maps submodule names to dicts")
            for key, value in entry.items():
                if type(key) is not str or key in _FORBIDDEN_METADATA:
                    raise self.fail(where, f"module metadata may not set {str(key)[:64]!r}")
                if value is not None and type(value) not in (bool, int, float, str):
                    raise self.fail(where, "module metadata values must be plain scalars")
        return metadata

    def _rng_state(self, payload: Any, path: KeyPath) -> dict[str, Any]:
        """What ``RNGState.state_dict()`` writes; the values themselves are checked
        against scratch generators when the restore is planned."""
        state = self._plain.decode(payload, path)
        if not isinstance(state, dict) or not (_RNG_REQUIRED <= set(state) <= _RNG_KEYS):
            raise self.fail(path, "$rng must hold the python, numpy, torch_cpu and cuda states")
        python = state["python"]
        if not (
            isinstance(python, tuple)
            and len(python) == 3
            and type(python[0]) is int
            and isinstance(python[1], tuple)
            and all(type(word) is int for word in python[1])
            and (python[2] is None or type(python[2]) is float)
        ):
            raise self.fail(path, "the saved Python RNG state is malformed")
        if not isinstance(state["numpy"], dict):
            raise self.fail(path, "the saved NumPy RNG state is malformed")
        cuda = state.get("cuda", [])
        if not _is_rng_state_tensor(state["torch_cpu"]) or not (
            isinstance(cuda, list) and all(_is_rng_state_tensor(t) for t in cuda)
        ):
            raise self.fail(path, "the saved torch RNG states must be 1-d uint8 tensors")
        return state


def decode_tree(
    tree: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], where: str
) -> dict[str, Any]:
    """Rebuild the saved state with placeholders for objects restored in place."""
    if not isinstance(tree, Mapping):
        raise FormatError(f"{where}: the state tree is not an object")
    decoder = _StateDecoder(tensors, where)
    return {key: decoder.decode(value, (key,)) for key, value in tree.items()}
