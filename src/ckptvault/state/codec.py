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
"""

from __future__ import annotations

import base64
import math
import re
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
_BIGINT_RE = re.compile(r"-?0x[0-9a-f]+")  # base 16: parsing is linear in the length
_MAX_SHAPE_RANK = 64  # dimensions of a $torch_size or $ndarray shape
_MAX_NAME = 64  # characters of a dtype or device name

# Every torch dtype the codec names, looked up from this fixed list: never
# ``getattr(torch, <string from the store>)``, which reaches deprecated functions
# and lazily imported submodules. Names this torch lacks are left out.
_TORCH_DTYPE_NAMES = (
    *DTYPES,  # what tensor files hold
    "complex32",
    "complex128",
    "float8_e8m0fnu",
    "float4_e2m1fn_x2",
    "quint8",
    "qint8",
    "qint32",
    "quint4x2",
    "quint2x4",
    "bits1x8",
    "bits2x4",
    "bits4x2",
    "bits8",
    "bits16",
    *(f"int{bits}" for bits in range(1, 8)),
    *(f"uint{bits}" for bits in range(1, 8)),
)
TORCH_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name in _TORCH_DTYPE_NAMES
    if isinstance(dtype := getattr(torch, name, None), torch.dtype)
    and str(dtype) == f"torch.{name}"
}
_DEVICE_RE = re.compile(r"[a-z][a-z0-9_]{0,31}(:[0-9]{1,4})?")
# ``dtype.str`` of a plain dtype: byte order, kind, item size, datetime unit.
_NUMPY_DTYPE_RE = re.compile(r"[<>|][biufcmMSUV][0-9]{1,9}(\[[0-9]{0,9}[A-Za-z]{1,2}\])?")
# NumPy kinds a scalar may have (exact in JSON) and an array may have (plain data).
_SCALAR_KINDS = "biuf"
_ARRAY_KINDS = "biufcmMSUV"


def torch_dtype_named(name: Any) -> torch.dtype | None:
    """The torch dtype called ``name`` (``"float32"``), or None for anything else."""
    return TORCH_DTYPES.get(name) if type(name) is str else None


def parse_device(text: Any) -> torch.device | None:
    """A device name from the store (``"cpu"``, ``"cuda:1"``), or None unless it
    parses and reads back exactly as written."""
    if type(text) is not str or len(text) > _MAX_NAME or not _DEVICE_RE.fullmatch(text):
        return None
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        return None
    return device if str(device) == text else None


def _plain_int(value: Any) -> bool:
    return type(value) is int


def _shape_of(payload: Any) -> list[int] | None:
    """A shape: a list of at most 64 non-negative plain ints, else None."""
    if type(payload) is not list or len(payload) > _MAX_SHAPE_RANK:
        return None
    if not all(_plain_int(d) and d >= 0 for d in payload):
        return None
    return payload


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
            name = str(value).removeprefix("torch.")
            if name not in TORCH_DTYPES:
                raise UnsupportedValueError(
                    format_path(path), value, f"readers do not know the dtype {value}"
                )
            return {"$torch_dtype": name}
        if isinstance(value, torch.device):
            if parse_device(str(value)) is None:
                raise UnsupportedValueError(
                    format_path(path), value, "readers would not parse this device name back"
                )
            return {"$torch_device": str(value)}
        if isinstance(value, torch.Size):
            if len(value) > _MAX_SHAPE_RANK:
                raise UnsupportedValueError(
                    format_path(path), value, f"sizes of more than {_MAX_SHAPE_RANK} dimensions"
                )
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
        dtype = array.dtype
        if (
            dtype.hasobject
            or dtype.fields is not None
            or dtype.kind not in _ARRAY_KINDS
            or dtype.itemsize == 0
            or not _NUMPY_DTYPE_RE.fullmatch(dtype.str)
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
        shown = format_path(path)  # keys come from the store: bound what is echoed
        if len(shown) > 300:
            shown = shown[:300] + "...]"
        return FormatError(f"{self.where}: {shown}: {message}")

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
        try:
            special = self.decode_special(tag, payload, path)
            if special is not NotImplemented:
                return special
            return self._decode_tag(tag, payload, path)
        except (TypeError, ValueError, KeyError, OverflowError, RuntimeError) as exc:
            # Payloads are checked before use; this is the backstop (numpy's overflow
            # of a scalar, a base64 error), so that nothing raw ever escapes decoding.
            raise self.fail(path, f"malformed {tag[:64]} value ({exc})") from exc

    def _decode_tag(self, tag: str, payload: Any, path: KeyPath) -> Any:
        # Each payload is checked for exactly the type and shape the encoder writes.
        if tag == "$float":
            if type(payload) is not str or payload not in _SPECIAL_FLOATS:
                raise self.fail(path, f"$float must be one of {', '.join(_SPECIAL_FLOATS)}")
            return _SPECIAL_FLOATS[payload]
        if tag == "$bigint":
            if type(payload) is not str or not _BIGINT_RE.fullmatch(payload):
                raise self.fail(path, "$bigint must be a lowercase hex string")
            return int(payload, 16)
        if tag == "$tuple":
            items = self._list(tag, payload, path)
            return tuple(self.decode(item, (*path, i)) for i, item in enumerate(items))
        if tag == "$dict":
            return self._decode_pairs(tag, payload, path)
        if tag == "$odict":
            return OrderedDict(self._decode_pairs(tag, payload, path))
        if tag == "$bytes":
            if type(payload) is not str:
                raise self.fail(path, "$bytes must be a base64 string")
            return base64.b64decode(payload, validate=True)
        if tag == "$tensor":
            if type(payload) is not str:
                raise self.fail(path, "$tensor must name a tensor")
            if self.tensors is None or payload not in self.tensors:
                raise self.fail(path, f"tensor {payload[:200]!r} is not in the checkpoint")
            return self.tensors[payload]
        if tag == "$ndarray":
            return self._decode_ndarray(payload, path)
        if tag == "$np_scalar":
            return self._decode_np_scalar(payload, path)
        if tag == "$torch_dtype":
            dtype = torch_dtype_named(payload)
            if dtype is None:
                raise self.fail(path, f"unknown torch dtype {str(payload)[:_MAX_NAME]!r}")
            return dtype
        if tag == "$torch_device":
            device = parse_device(payload)
            if device is None:
                raise self.fail(path, f"not a device name: {str(payload)[:_MAX_NAME]!r}")
            return device
        if tag == "$torch_size":
            shape = _shape_of(payload)
            if shape is None:
                raise self.fail(path, "$torch_size must be a list of non-negative ints")
            return torch.Size(shape)
        raise self.fail(path, f"unknown tag {tag[:_MAX_NAME]!r} (written by a newer ckptvault?)")

    def _list(self, tag: str, payload: Any, path: KeyPath) -> list[Any]:
        if type(payload) is not list:
            raise self.fail(path, f"{tag} must hold a list, not {type(payload).__name__}")
        return payload

    def _numpy_dtype(self, name: Any, kinds: str, path: KeyPath) -> np.dtype[Any]:
        """A plain NumPy dtype spelled exactly as ``dtype.str`` writes it."""
        if type(name) is not str or not _NUMPY_DTYPE_RE.fullmatch(name):
            raise self.fail(path, f"not a numpy dtype string: {str(name)[:_MAX_NAME]!r}")
        try:
            dtype = np.dtype(name)
        except (TypeError, ValueError) as exc:
            raise self.fail(path, f"unknown numpy dtype {name!r}") from exc
        if (
            dtype.str != name
            or dtype.kind not in kinds
            or dtype.hasobject
            or dtype.fields is not None
            or dtype.subdtype is not None
            or dtype.itemsize == 0
        ):
            raise self.fail(path, f"refusing numpy dtype {name!r}")
        return dtype

    def _decode_ndarray(self, payload: Any, path: KeyPath) -> np.ndarray:
        if type(payload) is not dict or set(payload) != {"dtype", "shape", "data"}:
            raise self.fail(path, "$ndarray must hold exactly dtype, shape and data")
        dtype = self._numpy_dtype(payload["dtype"], _ARRAY_KINDS, path)
        shape = _shape_of(payload["shape"])
        if shape is None or type(payload["data"]) is not str:
            raise self.fail(path, "$ndarray needs a shape of non-negative ints and base64 data")
        data = base64.b64decode(payload["data"], validate=True)
        if math.prod(shape) * dtype.itemsize != len(data):
            raise self.fail(
                path, f"$ndarray of {dtype} {shape} does not match its {len(data)} data bytes"
            )
        return np.frombuffer(data, dtype=dtype).reshape(shape).copy()

    def _decode_np_scalar(self, payload: Any, path: KeyPath) -> np.generic:
        if type(payload) is not dict or set(payload) != {"dtype", "value"}:
            raise self.fail(path, "$np_scalar must hold exactly dtype and value")
        dtype = self._numpy_dtype(payload["dtype"], _SCALAR_KINDS, path)
        value = self.decode(payload["value"], path)
        # Exactly what ``.item()`` gave when it was saved: bool, int or float.
        expected = {"b": bool, "i": int, "u": int, "f": float}[dtype.kind]
        if type(value) is not expected:
            raise self.fail(
                path, f"a numpy {dtype} scalar's value must be of type {expected.__name__}"
            )
        return dtype.type(value)

    def _decode_pairs(self, tag: str, payload: Any, path: KeyPath) -> dict[Any, Any]:
        result: dict[Any, Any] = {}
        keys = Decoder(None, self.where)
        for pair in self._list(tag, payload, path):
            if type(pair) is not list or len(pair) != 2:
                raise self.fail(path, f"{tag} must hold [key, value] pairs")
            key = keys.decode(pair[0], path)
            try:
                hash(key)
            except TypeError:
                raise self.fail(
                    path, f"{tag} key of type {type(key).__name__} is unhashable"
                ) from None
            if key in result:
                raise self.fail(path, f"{tag} holds the key {str(key)[:80]!r} twice")
            result[key] = self.decode(pair[1], (*path, key))
        return result


def encode_plain(value: Any, path: KeyPath = ()) -> Any:
    """Encode a value that may not contain tensors (contracts, metadata)."""
    return Encoder(None).encode(value, path)


def decode_plain(obj: Any, where: str) -> Any:
    return Decoder(None, where).decode(obj, ())
