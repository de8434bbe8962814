"""What the codec's encoder and decoder agree on, besides the tags.

Key paths and the names they give tensors and error messages; the torch dtypes and
device names a checkpoint may name (looked up in fixed tables, never imported by
name); the NumPy dtype spellings and kinds it carries; what a shape is; and the
limits that bound them. :mod:`ckptvault.state.codec` describes the format.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch

from ckptvault.format.tensorfile import DTYPES

KeyPath = tuple[Any, ...]

MAX_SHAPE_RANK = 64  # dimensions of a $torch_size or $ndarray shape
MAX_NAME = 64  # characters of a dtype or device name

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
NUMPY_DTYPE_RE = re.compile(r"[<>|][biufcmMSUV][0-9]{1,9}(\[[0-9]{0,9}[A-Za-z]{1,2}\])?")
# NumPy kinds a scalar may have (exact in JSON) and an array may have (plain data).
SCALAR_KINDS = "biuf"
ARRAY_KINDS = "biufcmMSUV"


def torch_dtype_named(name: Any) -> torch.dtype | None:
    """The torch dtype called ``name`` (``"float32"``), or None for anything else."""
    return TORCH_DTYPES.get(name) if type(name) is str else None


def parse_device(text: Any) -> torch.device | None:
    """A device name from the store (``"cpu"``, ``"cuda:1"``), or None unless it
    parses and reads back exactly as written."""
    if type(text) is not str or len(text) > MAX_NAME or not _DEVICE_RE.fullmatch(text):
        return None
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        return None
    return device if str(device) == text else None


def _plain_int(value: Any) -> bool:
    return type(value) is int


def shape_of(payload: Any) -> list[int] | None:
    """A shape: a list of at most 64 non-negative plain ints, else None."""
    if type(payload) is not list or len(payload) > MAX_SHAPE_RANK:
        return None
    if not all(_plain_int(d) and d >= 0 for d in payload):
        return None
    return payload


def _spelled(segment: Any, spell: Callable[[Any], str]) -> str:
    """``spell(segment)`` (``str`` or ``repr``), except that an int too long for
    CPython's decimal conversion (4300 digits; a dict key may be one) is spelled in
    hex, inside tuples too: naming a key path must never raise itself."""
    if type(segment) is int:
        try:
            return spell(segment)
        except ValueError:
            return hex(segment)
    if type(segment) is tuple:
        items = [_spelled(item, repr) for item in segment]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    return spell(segment)


def format_path(path: KeyPath) -> str:
    """``("meta", "lr", 0)`` -> ``state["meta"]["lr"][0]``."""
    return "state" + "".join(f"[{_spelled(segment, repr)}]" for segment in path)


def _escape_segment(segment: Any) -> str:
    if type(segment) is str and "~" not in segment and "/" not in segment:
        return segment  # the common case, and the hot one: one call per tensor per level
    return _spelled(segment, str).replace("~", "~0").replace("/", "~1")


def tensor_key(path: KeyPath) -> str:
    """The flat name a tensor gets in DCP metadata and tensor files."""
    return "/".join(_escape_segment(segment) for segment in path)
