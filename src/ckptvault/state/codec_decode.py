"""Decoding the codec's tagged JSON back into values, checking every payload.

The inverse of :class:`~ckptvault.state.codec.Encoder` (the format is described in
:mod:`ckptvault.state.codec`). What the store holds was chosen by whoever could
write it, so every tagged payload is checked for exactly the type and shape the
encoder writes; a malformed one is a :class:`FormatError`, never a raw exception,
and an unknown tag is refused.
"""

from __future__ import annotations

import base64
import math
import re
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ckptvault.errors import FormatError
from ckptvault.state.codec_names import (
    ARRAY_KINDS,
    MAX_NAME,
    NUMPY_DTYPE_RE,
    SCALAR_KINDS,
    KeyPath,
    format_path,
    parse_device,
    shape_of,
    torch_dtype_named,
)

_SPECIAL_FLOATS = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "-0.0": -0.0}
_BIGINT_RE = re.compile(r"-?0x[0-9a-f]+")  # base 16: parsing is linear in the length


class Decoder:
    """Inverse of :class:`~ckptvault.state.codec.Encoder`; ``tensors`` resolves ``$tensor`` references."""

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
        if tag == "$tensor":  # first: one per tensor, the tag met most by far
            if type(payload) is not str:
                raise self.fail(path, "$tensor must name a tensor")
            if self.tensors is None or payload not in self.tensors:
                raise self.fail(path, f"tensor {payload[:200]!r} is not in the checkpoint")
            return self.tensors[payload]
        if tag == "$float":
            if type(payload) is not str or payload not in _SPECIAL_FLOATS:
                raise self.fail(path, f"$float must be one of {', '.join(_SPECIAL_FLOATS)}")
            # A new float each time: two NaN keys of one dict stay two keys.
            return float(payload)
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
        if tag == "$ndarray":
            return self._decode_ndarray(payload, path)
        if tag == "$np_scalar":
            return self._decode_np_scalar(payload, path)
        if tag == "$torch_dtype":
            dtype = torch_dtype_named(payload)
            if dtype is None:
                raise self.fail(path, f"unknown torch dtype {str(payload)[:MAX_NAME]!r}")
            return dtype
        if tag == "$torch_device":
            device = parse_device(payload)
            if device is None:
                raise self.fail(path, f"not a device name: {str(payload)[:MAX_NAME]!r}")
            return device
        if tag == "$torch_size":
            shape = shape_of(payload)
            if shape is None:
                raise self.fail(path, "$torch_size must be a list of non-negative ints")
            return torch.Size(shape)
        raise self.fail(path, f"unknown tag {tag[:MAX_NAME]!r} (written by a newer ckptvault?)")

    def _list(self, tag: str, payload: Any, path: KeyPath) -> list[Any]:
        if type(payload) is not list:
            raise self.fail(path, f"{tag} must hold a list, not {type(payload).__name__}")
        return payload

    def _numpy_dtype(self, name: Any, kinds: str, path: KeyPath) -> np.dtype[Any]:
        """A plain NumPy dtype spelled exactly as ``dtype.str`` writes it."""
        if type(name) is not str or not NUMPY_DTYPE_RE.fullmatch(name):
            raise self.fail(path, f"not a numpy dtype string: {str(name)[:MAX_NAME]!r}")
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
        dtype = self._numpy_dtype(payload["dtype"], ARRAY_KINDS, path)
        shape = shape_of(payload["shape"])
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
        dtype = self._numpy_dtype(payload["dtype"], SCALAR_KINDS, path)
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


def decode_plain(obj: Any, where: str) -> Any:
    return Decoder(None, where).decode(obj, ())
