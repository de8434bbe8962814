"""A strict, pickle-free JSON codec for the non-tensor leaves of training state.

Plain JSON carries ``None``, ``bool``, ``str``, finite ``float`` and ``int``, lists,
and dicts with string keys. Everything JSON cannot say exactly is an explicit
single-key tagged object whose key starts with ``$``:

====================  ============================================================
``$float``            ``"nan"``, ``"inf"``, ``"-inf"`` or ``"-0.0"``
``$bigint``           an int too long for JSON parsers' digit limits, as hex
``$tuple``            a tuple, as a list of values
``$dict``             a dict whose keys are not strings in sorted order (JSON objects
                      lose order and non-string keys): ``[[k, v], ...]``
``$odict``            a ``collections.OrderedDict``: ``[[k, v], ...]``
``$bytes``            base64
``$ndarray``          a NumPy array: dtype, shape, base64 of its C-order bytes
``$np_scalar``        a NumPy scalar: dtype and value
``$torch_dtype``      / ``$torch_device`` / ``$torch_size``
``$tensor``           a reference (key) into the checkpoint's tensor files
====================  ============================================================

Any other type raises :class:`UnsupportedValueError` at save time, naming the key
path. Decoding refuses unknown tags, and checks every tagged payload's type and
shape strictly (what the store holds was chosen by whoever could write it): a
malformed one is a :class:`FormatError`, never a raw exception. Nothing is ever
executed or imported by name: dtypes come from an explicit table of names, devices
are parsed and must read back exactly as written.

This module holds the :class:`Encoder`; the :class:`Decoder` is in
:mod:`ckptvault.state.codec_decode`, what both agree on (key paths, dtype and device
names, shapes) in :mod:`ckptvault.state.codec_names`. Both are importable from here.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ckptvault.errors import UnsupportedValueError
from ckptvault.format.tensorfile import DTYPES
from ckptvault.state.codec_decode import Decoder, decode_plain
from ckptvault.state.codec_names import (
    ARRAY_KINDS,
    MAX_SHAPE_RANK,
    NUMPY_DTYPE_RE,
    TORCH_DTYPES,
    KeyPath,
    format_path,
    parse_device,
    tensor_key,
    torch_dtype_named,
)

__all__ = [
    "MAX_NESTING",
    "TORCH_DTYPES",
    "Decoder",
    "Encoder",
    "KeyPath",
    "TensorSink",
    "decode_plain",
    "encode_plain",
    "format_path",
    "parse_device",
    "tensor_key",
    "torch_dtype_named",
]

TensorSink = Callable[[KeyPath, torch.Tensor], str]

# Key-path depth a value may have: each level takes at most 3 levels of JSON (a
# $dict pair), so the manifest stays inside the 128 levels readers parse.
MAX_NESTING = 32
_BIGINT_BITS = 10_000  # ~3000 decimal digits, well inside CPython's 4300-digit limit


class Encoder:
    """Turns a value into tagged JSON; tensors go to ``tensor_sink``.

    Subclasses extend :meth:`encode_special` to give certain objects their own tags.
    """

    def __init__(self, tensor_sink: TensorSink | None) -> None:
        self.tensor_sink = tensor_sink

    def encode_special(self, value: Any, path: KeyPath) -> Any:
        return NotImplemented

    def encode(self, value: Any, path: KeyPath) -> Any:
        if len(path) > MAX_NESTING:
            raise UnsupportedValueError(
                format_path(path[:8]) + "[...]",
                value,
                f"values nested more than {MAX_NESTING} levels deep cannot be read back "
                "(readers bound the depth of the JSON they parse); flatten the structure",
            )
        special = self.encode_special(value, path)
        if special is not NotImplemented:
            return special
        # Exact types first (a subclass of int, str, dict ... is refused, not
        # flattened); then the few families whose subclasses are encoded or refused.
        exact = _BY_EXACT_TYPE.get(type(value))
        if exact is not None:
            return exact(self, value, path)
        for family, encode_member in _BY_FAMILY:
            if isinstance(value, family):
                return encode_member(self, value, path)
        raise UnsupportedValueError(format_path(path), value, _hint_for(value))

    def _encode_list(self, value: list[Any], path: KeyPath) -> Any:
        return [self.encode(item, (*path, index)) for index, item in enumerate(value)]

    def _encode_tuple(self, value: tuple[Any, ...], path: KeyPath) -> Any:
        return {"$tuple": [self.encode(item, (*path, i)) for i, item in enumerate(value)]}

    def _encode_dict(self, value: dict[Any, Any], path: KeyPath) -> Any:
        keys = list(value)
        # A plain JSON object only when nothing is lost: canonical JSON sorts keys,
        # so dicts in another order keep it as a list of pairs.
        if all(type(k) is str and not k.startswith("$") for k in keys) and keys == sorted(keys):
            return {_checked_str(k, path): self.encode(v, (*path, k)) for k, v in value.items()}
        return {"$dict": self._encode_pairs(value, path)}

    def _encode_odict(self, value: OrderedDict[Any, Any], path: KeyPath) -> Any:
        return {"$odict": self._encode_pairs(value, path)}

    def _encode_pairs(self, value: Mapping[Any, Any], path: KeyPath) -> list[list[Any]]:
        keys = Encoder(None)  # keys never hold tensors
        return [[keys.encode(k, (*path, k)), self.encode(v, (*path, k))] for k, v in value.items()]

    def _encode_tensor(self, tensor: torch.Tensor, path: KeyPath) -> Any:
        if self.tensor_sink is None:
            raise UnsupportedValueError(format_path(path), tensor, "tensors cannot be used here")
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
            raise UnsupportedValueError(
                format_path(path), tensor, "only dense (strided) tensors can be checkpointed"
            )
        if tensor.is_meta:
            raise UnsupportedValueError(
                format_path(path), tensor, "meta tensors hold no data; materialize them first"
            )
        if tensor.dtype not in _SAVABLE_DTYPES:
            raise UnsupportedValueError(
                format_path(path),
                tensor,
                f"dtype {tensor.dtype} has no safetensors encoding; supported: {', '.join(sorted(DTYPES))}",
            )
        return {"$tensor": self.tensor_sink(path, tensor)}

    def _encode_ndarray(self, array: np.ndarray, path: KeyPath) -> Any:
        dtype = array.dtype
        if (
            dtype.hasobject
            or dtype.fields is not None
            or dtype.kind not in ARRAY_KINDS
            or dtype.itemsize == 0
            or not NUMPY_DTYPE_RE.fullmatch(dtype.str)
        ):
            raise UnsupportedValueError(
                format_path(path), array, f"numpy dtype {array.dtype} is not plain data"
            )
        data = np.ascontiguousarray(array).tobytes()
        return {
            "$ndarray": {
                "dtype": array.dtype.str,
                "shape": list(array.shape),
                "data": base64.b64encode(data).decode("ascii"),
            }
        }

    def _encode_np_scalar(self, value: np.generic, path: KeyPath) -> Any:
        plain = value.item()
        if isinstance(plain, np.generic) or value.dtype.kind not in "biuf":
            raise UnsupportedValueError(
                format_path(path), value, f"numpy {value.dtype} scalars have no exact JSON form"
            )
        return {"$np_scalar": {"dtype": value.dtype.str, "value": self.encode(plain, path)}}


# Each branch takes (encoder, value, key path) and returns the value's JSON form.
_Branch = Callable[[Encoder, Any, KeyPath], Any]


def _as_is(encoder: Encoder, value: Any, path: KeyPath) -> Any:
    return value


def _encode_str(encoder: Encoder, value: str, path: KeyPath) -> Any:
    return _checked_str(value, path)


def _encode_int(encoder: Encoder, value: int, path: KeyPath) -> Any:
    if value.bit_length() > _BIGINT_BITS:
        return {"$bigint": hex(value)}
    return value


def _encode_float(encoder: Encoder, value: float, path: KeyPath) -> Any:
    if math.isnan(value):
        return {"$float": "nan"}
    if math.isinf(value):
        return {"$float": "inf" if value > 0 else "-inf"}
    if value == 0.0 and math.copysign(1.0, value) < 0:
        return {"$float": "-0.0"}
    return value


def _encode_bytes(encoder: Encoder, value: bytes, path: KeyPath) -> Any:
    return {"$bytes": base64.b64encode(value).decode("ascii")}


def _refuse_ndarray_subclass(encoder: Encoder, value: np.ndarray, path: KeyPath) -> Any:
    raise UnsupportedValueError(
        format_path(path),
        value,
        "numpy array subclasses (masked, matrix, ...) would lose "
        "their meaning; convert with np.asarray or store their parts",
    )


def _encode_torch_dtype(encoder: Encoder, value: torch.dtype, path: KeyPath) -> Any:
    name = str(value).removeprefix("torch.")
    if name not in TORCH_DTYPES:
        raise UnsupportedValueError(
            format_path(path), value, f"readers do not know the dtype {value}"
        )
    return {"$torch_dtype": name}


def _encode_torch_device(encoder: Encoder, value: torch.device, path: KeyPath) -> Any:
    if parse_device(str(value)) is None:
        raise UnsupportedValueError(
            format_path(path), value, "readers would not parse this device name back"
        )
    return {"$torch_device": str(value)}


def _encode_torch_size(encoder: Encoder, value: torch.Size, path: KeyPath) -> Any:
    if len(value) > MAX_SHAPE_RANK:
        raise UnsupportedValueError(
            format_path(path), value, f"sizes of more than {MAX_SHAPE_RANK} dimensions"
        )
    return {"$torch_size": list(value)}


# The dtypes a tensor file can hold, as torch.dtype objects (a set lookup per tensor).
_SAVABLE_DTYPES = frozenset(
    dtype
    for dtype in (getattr(torch, name, None) for name in DTYPES)
    if isinstance(dtype, torch.dtype)
)

_BY_EXACT_TYPE: dict[type, _Branch] = {
    type(None): _as_is,
    bool: _as_is,
    str: _encode_str,
    int: _encode_int,
    float: _encode_float,
    list: Encoder._encode_list,
    tuple: Encoder._encode_tuple,
    dict: Encoder._encode_dict,
    OrderedDict: Encoder._encode_odict,
    bytes: _encode_bytes,
    np.ndarray: Encoder._encode_ndarray,
}
# Checked in this order, after the exact types: tensors (parameters too), then what
# NumPy and torch types remain; torch.Size is a tuple subclass and is matched here.
_BY_FAMILY: tuple[tuple[type, _Branch], ...] = (
    (torch.Tensor, Encoder._encode_tensor),
    (np.ndarray, _refuse_ndarray_subclass),
    (np.generic, Encoder._encode_np_scalar),
    (torch.dtype, _encode_torch_dtype),
    (torch.device, _encode_torch_device),
    (torch.Size, _encode_torch_size),
)


def _checked_str(value: str, path: KeyPath) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsupportedValueError(
            format_path(path), value, "the string holds a lone surrogate, which UTF-8 cannot store"
        ) from None
    return value


def _hint_for(value: Any) -> str:
    if callable(value):
        return "functions and callables cannot be stored; keep them in code, store their config"
    if isinstance(value, (set, frozenset)):
        return "convert sets to sorted lists"
    if isinstance(value, (int, str)):
        return "subclasses (enums, ...) are refused; store the plain int/str value"
    return ""


def encode_plain(value: Any, path: KeyPath = ()) -> Any:
    """Encode a value that may not contain tensors (contracts, metadata)."""
    return Encoder(None).encode(value, path)
