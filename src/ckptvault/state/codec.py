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
path. Decoding refuses unknown tags. Nothing is ever executed or imported by name.
"""

from __future__ import annotations

import base64
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ckptvault.errors import FormatError, UnsupportedValueError
from ckptvault.format.tensorfile import DTYPES

KeyPath = tuple[Any, ...]
TensorSink = Callable[[KeyPath, torch.Tensor], str]

# Key-path depth a value may have: each level takes at most 3 levels of JSON (a
# $dict pair), so the manifest stays inside the 128 levels readers parse.
MAX_NESTING = 32
_BIGINT_BITS = 10_000  # ~3000 decimal digits, well inside CPython's 4300-digit limit
_SPECIAL_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "-0.0": -0.0}


def format_path(path: KeyPath) -> str:
    """``("meta", "lr", 0)`` -> ``state["meta"]["lr"][0]``."""
    return "state" + "".join(f"[{segment!r}]" for segment in path)


def _escape_segment(segment: Any) -> str:
    return str(segment).replace("~", "~0").replace("/", "~1")


def tensor_key(path: KeyPath) -> str:
    """The flat name a tensor gets in DCP metadata and tensor files."""
    return "/".join(_escape_segment(segment) for segment in path)


def _encode_float(value: float) -> Any:
    if math.isnan(value):
        return {"$float": "nan"}
    if math.isinf(value):
        return {"$float": "inf" if value > 0 else "-inf"}
    if value == 0.0 and math.copysign(1.0, value) < 0:
        return {"$float": "-0.0"}
    return value


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
        kind = type(value)
        if value is None or kind is bool:
            return value
        if kind is str:
            return _checked_str(value, path)
        if kind is int:
            if value.bit_length() > _BIGINT_BITS:
                return {"$bigint": hex(value)}
            return value
        if kind is float:
            return _encode_float(value)
        if kind is list:
            return [self.encode(item, (*path, index)) for index, item in enumerate(value)]
        if kind is tuple:
            return {"$tuple": [self.encode(item, (*path, i)) for i, item in enumerate(value)]}
        if kind is dict:
            keys = list(value)
            # A plain JSON object only when nothing is lost: canonical JSON sorts keys,
            # so dicts in another order keep it as a list of pairs.
            if all(type(k) is str and not k.startswith("$") for k in keys) and keys == sorted(keys):
                return {_checked_str(k, path): self.encode(v, (*path, k)) for k, v in value.items()}
            return {"$dict": self._encode_pairs(value, path)}
        if kind is OrderedDict:
            return {"$odict": self._encode_pairs(value, path)}
        if kind is bytes:
            return {"$bytes": base64.b64encode(value).decode("ascii")}
        if isinstance(value, torch.Tensor):
            return self._encode_tensor(value, path)
        if kind is np.ndarray:
            return self._encode_ndarray(value, path)
        if isinstance(value, np.ndarray):
            raise UnsupportedValueError(
                format_path(path),
                value,
                "numpy array subclasses (masked, matrix, ...) would lose "
                "their meaning; convert with np.asarray or store their parts",
            )
        if isinstance(value, np.generic):
            return self._encode_np_scalar(value, path)
        if isinstance(value, torch.dtype):
            return {"$torch_dtype": str(value).removeprefix("torch.")}
        if isinstance(value, torch.device):
            return {"$torch_device": str(value)}
        if isinstance(value, torch.Size):
            return {"$torch_size": list(value)}
        raise UnsupportedValueError(format_path(path), value, _hint_for(value))

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
        if tensor.device.type == "meta":
            raise UnsupportedValueError(
                format_path(path), tensor, "meta tensors hold no data; materialize them first"
            )
        if str(tensor.dtype).removeprefix("torch.") not in DTYPES:
            raise UnsupportedValueError(
                format_path(path),
                tensor,
                f"dtype {tensor.dtype} has no safetensors encoding; supported: {', '.join(sorted(DTYPES))}",
            )
        return {"$tensor": self.tensor_sink(path, tensor)}

    def _encode_ndarray(self, array: np.ndarray, path: KeyPath) -> Any:
        if array.dtype.hasobject or array.dtype.fields is not None:
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


class Decoder:
    """Inverse of :class:`Encoder`; ``tensors`` resolves ``$tensor`` references."""

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None, where: str) -> None:
        self.tensors = tensors
        self.where = where

    def decode_special(self, tag: str, payload: Any, path: KeyPath) -> Any:
        return NotImplemented

    def fail(self, path: KeyPath, message: str) -> FormatError:
        return FormatError(f"{self.where}: {format_path(path)}: {message}")

    def decode(self, obj: Any, path: KeyPath) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, list):
            return [self.decode(item, (*path, index)) for index, item in enumerate(obj)]
        if not isinstance(obj, dict):
            raise self.fail(path, f"unexpected JSON value of type {type(obj).__name__}")
        tags = [key for key in obj if key.startswith("$")]
        if not tags:
            return {key: self.decode(value, (*path, key)) for key, value in obj.items()}
        if len(obj) != 1:
            raise self.fail(path, "tagged value has extra keys")
        tag = tags[0]
        payload = obj[tag]
        special = self.decode_special(tag, payload, path)
        if special is not NotImplemented:
            return special
        try:
            return self._decode_tag(tag, payload, path)
        except (TypeError, ValueError, KeyError, OverflowError, RuntimeError) as exc:
            # RuntimeError: torch's for an unknown device or an unrepresentable size.
            raise self.fail(path, f"malformed {tag} value ({exc})") from exc

    def _decode_tag(self, tag: str, payload: Any, path: KeyPath) -> Any:
        if tag == "$float":
            return _SPECIAL_FLOATS[payload]
        if tag == "$bigint":
            return int(payload, 16)
        if tag == "$tuple":
            return tuple(self.decode(item, (*path, i)) for i, item in enumerate(payload))
        if tag == "$dict":
            return self._decode_pairs(payload, path)
        if tag == "$odict":
            return OrderedDict(self._decode_pairs(payload, path))
        if tag == "$bytes":
            return base64.b64decode(payload, validate=True)
        if tag == "$tensor":
            if self.tensors is None or payload not in self.tensors:
                raise self.fail(path, f"tensor {payload!r} is not in the checkpoint")
            return self.tensors[payload]
        if tag == "$ndarray":
            dtype = np.dtype(payload["dtype"])
            if dtype.hasobject or dtype.fields is not None:
                raise self.fail(path, f"refusing numpy dtype {dtype}")
            data = base64.b64decode(payload["data"], validate=True)
            return np.frombuffer(data, dtype=dtype).reshape(payload["shape"]).copy()
        if tag == "$np_scalar":
            dtype = np.dtype(payload["dtype"])
            if dtype.hasobject or dtype.fields is not None:
                raise self.fail(path, f"refusing numpy dtype {dtype}")
            return dtype.type(self.decode(payload["value"], path))
        if tag == "$torch_dtype":
            dtype = getattr(torch, payload, None)
            if not isinstance(dtype, torch.dtype):
                raise self.fail(path, f"unknown torch dtype {payload!r}")
            return dtype
        if tag == "$torch_device":
            return torch.device(payload)
        if tag == "$torch_size":
            return torch.Size(int(d) for d in payload)
        raise self.fail(path, f"unknown tag {tag!r} (written by a newer ckptvault?)")

    def _decode_pairs(self, payload: list[list[Any]], path: KeyPath) -> dict[Any, Any]:
        result: dict[Any, Any] = {}
        keys = Decoder(None, self.where)
        for key_obj, value_obj in payload:
            key = keys.decode(key_obj, path)
            result[key] = self.decode(value_obj, (*path, key))
        return result


def encode_plain(value: Any, path: KeyPath = ()) -> Any:
    """Encode a value that may not contain tensors (contracts, metadata)."""
    return Encoder(None).encode(value, path)


def decode_plain(obj: Any, where: str) -> Any:
    return Decoder(None, where).decode(obj, ())
