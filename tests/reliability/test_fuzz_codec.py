"""Fuzzing the pickle-free JSON codec of non-tensor state (``ckptvault.state.codec``),
through the entry points a save and a restore use: ``capture_state`` splits a state
dict into tensors and a JSON tree, the tree goes through canonical JSON at the depth
a manifest allows, and ``decode_tree`` rebuilds it.

- Round trip: every value the codec supports comes back exactly: the same types
  (tuple vs list, bool vs int, dict vs OrderedDict, NumPy scalar vs Python number),
  the same float bits (-0.0, infinities; NaN stays NaN: the format has one NaN), the
  same dict order, bit-identical NumPy arrays and tensors.
- Unsupported values anywhere in a structure raise ``UnsupportedValueError`` naming
  the exact key path, before anything is written.
- Hostile trees (JSON-level edits of real and generated trees, arbitrary JSON) and
  hostile bytes decode or are refused with a ckptvault error, never a raw exception.
"""

from __future__ import annotations

import decimal
import enum
import fractions
import json
import math
import struct
from collections import OrderedDict, defaultdict
from datetime import datetime
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from ckptvault.errors import UnsupportedValueError
from ckptvault.format.canonical import dumps_canonical, loads_canonical
from ckptvault.format.manifest import MAX_MANIFEST_DEPTH
from ckptvault.state.capture import capture_state, decode_tree
from ckptvault.state.codec import MAX_NESTING, TORCH_DTYPES, format_path
from support.common import make_training_state, train_steps
from support.fuzzing import (
    fuzz_settings,
    hostile_json,
    measured,
    mutated_bytes,
    mutated_json,
    refused,
    render,
    same_tensor,
    scenario,
)

pytestmark = [pytest.mark.fuzz, pytest.mark.reliability]

# -- supported values -------------------------------------------------------------------

floats = st.floats() | st.sampled_from([0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324])
# Past the 10,000 bits the codec writes as $bigint. (Built from small draws: hypothesis
# cannot show a drawn integer of more than 4,300 digits when it shrinks.)
big_ints = st.builds(
    lambda sign, bits, low: sign * ((1 << bits) + low),
    st.sampled_from([1, -1]),
    st.integers(9_990, 20_000),
    st.integers(0, 2**64),
)
ints = st.integers() | big_ints
texts = st.text(max_size=12)  # hypothesis's text never holds a lone surrogate
numpy_dtypes = st.one_of(
    hnp.scalar_dtypes(),
    hnp.scalar_dtypes().map(lambda dtype: dtype.newbyteorder(">")),
    hnp.byte_string_dtypes(max_len=4),
    hnp.unicode_string_dtypes(max_len=4),
    hnp.datetime64_dtypes(),
    hnp.timedelta64_dtypes(),
)
shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3)


def _void_array(shape: tuple[int, ...], size: int, data: bytes) -> np.ndarray:
    count = math.prod(shape) * size
    return np.frombuffer((data * count)[:count], dtype=f"V{size}").reshape(shape)


# Opaque bytes (kind V), which hypothesis's arrays() cannot generate.
void_arrays = st.builds(_void_array, shapes, st.integers(1, 4), st.binary(min_size=1, max_size=4))
arrays = numpy_dtypes.flatmap(lambda dtype: hnp.arrays(dtype, shapes)) | void_arrays
SCALAR_TYPES = ("bool", "int8", "uint8", "int16", "uint32", "int64", "uint64", "float16")
numpy_scalars = (
    st.sampled_from([*SCALAR_TYPES, "float32", ">f8"])
    .map(np.dtype)
    .flatmap(lambda dtype: hnp.from_dtype(dtype).map(dtype.type))
)
tensors = st.builds(
    lambda shape, dtype: torch.randn(shape).to(dtype),
    st.lists(st.integers(0, 3), max_size=3),
    st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]),
)
leaves = st.one_of(
    st.none(),
    st.booleans(),
    ints,
    floats,
    texts,
    st.binary(max_size=12),
    arrays,
    numpy_scalars,
    st.sampled_from(sorted(TORCH_DTYPES.values(), key=str)),
    st.sampled_from(["cpu", "cuda", "cuda:0", "meta", "xpu:3"]).map(torch.device),
    st.lists(st.integers(0, 2**40), max_size=4).map(torch.Size),
    tensors,
)
hashables = st.recursive(
    st.none() | st.booleans() | ints | floats | texts | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=3).map(tuple),
    max_leaves=4,
)


scalar_keys = st.none() | st.booleans() | ints | floats | st.binary(max_size=4)


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(texts, inner, max_size=3),  # plain JSON object or $dict by order
        st.dictionaries(hashables, inner, max_size=3),
        st.dictionaries(hashables, inner, max_size=3).map(OrderedDict),
    )


values = st.recursive(leaves, _containers, max_leaves=16)


@st.composite
def deep_values(draw: st.DrawFn) -> Any:
    """A chain of containers as deep as the codec allows (its key path may be 32
    long; the state entry's own key is the first), each kind as deep in JSON as it
    gets ($dict pairs: 3 levels), so the tree must still fit the manifest's depth."""
    value = draw(leaves)
    for _ in range(draw(st.integers(MAX_NESTING - 4, MAX_NESTING - 1))):
        kind = draw(st.sampled_from(["list", "tuple", "dict", "keyed", "odict"]))
        if kind == "list":
            value = [value]
        elif kind == "tuple":
            value = (value,)
        elif kind == "dict":
            value = {"k": value}
        else:
            # Not a tuple: its items would sit one level deeper than the value.
            key = draw(scalar_keys)
            value = {key: value} if kind == "keyed" else OrderedDict([(key, value)])
    return value


def float_bits(value: float) -> bytes:
    return b"nan" if math.isnan(value) else struct.pack(">d", value)


def same(a: Any, b: Any) -> bool:
    """Exact equality: same types all the way down, float bits (any NaN is NaN),
    dict order, NumPy dtype, shape and bytes, tensors' dtype, shape and bytes."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return float_bits(a) == float_bits(b)
    if isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return (
            len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b, strict=True))
            and all(same(x, y) for x, y in zip(a.values(), b.values(), strict=True))
        )
    if isinstance(a, np.ndarray):
        return a.dtype.str == b.dtype.str and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and (a.tobytes() == b.tobytes() or (np.isnan(a) and np.isnan(b)))
    if isinstance(a, torch.Tensor):
        return same_tensor(a, b)
    return a == b


def through_the_store(value: Any) -> Any:
    """Capture ``{"v": value}``, write its tree as a manifest holds it, read it back."""
    captured = capture_state({"v": value})
    data = dumps_canonical({"state": captured.tree})
    tree = loads_canonical(data, "fuzz", max_depth=MAX_MANIFEST_DEPTH)["state"]
    return decode_tree(tree, captured.tensors, "fuzz")["v"]


def test_codec_round_trip():
    with scenario("fuzz: state codec round trip") as trials:

        @fuzz_settings(ci=300, long=5_000)
        @given(values | deep_values())
        # Two distinct NaN keys are two keys: the restore must not call them one.
        @example({float("nan"): 1, float("nan"): 2})
        @example(OrderedDict([((float("nan"),), 1), ((float("nan"),), 2)]))
        # Key paths through ints too long for str(): a tensor's name, an error.
        @example({(1 << 20_000, "k"): [torch.zeros(2)]})
        def round_trip(value: Any) -> None:
            trials.count()
            try:
                restored = through_the_store(value)
            except UnsupportedValueError as exc:
                # Documented: two tensors whose key paths flatten to one name (key 1
                # and key "1") are refused at save time, naming both.
                if "collides with" not in str(exc):
                    raise
                trials.outcome("refused: tensor names collide")
                return
            assert same(restored, value)
            trials.outcome("round-tripped")

        round_trip()


# -- unsupported values -----------------------------------------------------------------


class Color(enum.Enum):
    RED = 1


class Level(enum.IntEnum):
    LOW = 1


class Name(str):
    pass


UNSUPPORTED = [
    lambda: {1, 2},
    lambda: frozenset(),
    lambda: object(),
    lambda: lambda: None,
    lambda: Color.RED,
    lambda: Level.LOW,
    lambda: Name("x"),
    lambda: defaultdict(int),
    lambda: 1j,
    lambda: decimal.Decimal("1.5"),
    lambda: fractions.Fraction(1, 3),
    lambda: datetime(2024, 1, 1),
    lambda: range(3),
    lambda: bytearray(b"x"),
    lambda: "lone \ud800 surrogate",
    lambda: np.ma.masked_array([1, 2], mask=[0, 1]),
    lambda: np.array([object()], dtype=object),
    lambda: np.zeros(2, dtype=[("a", "i4")]),
    lambda: np.longdouble(1.5),
    lambda: np.complex64(1j),
    lambda: torch.zeros(2).to_sparse(),
    lambda: torch.empty(2, device="meta"),
    lambda: torch.zeros(2, dtype=torch.complex128),
    lambda: Exception("x"),
]


@st.composite
def planted(draw: st.DrawFn) -> tuple[Any, tuple[Any, ...]]:
    """A structure with one unsupported value somewhere, and that value's key path."""
    value = draw(st.sampled_from(UNSUPPORTED))()
    path: list[Any] = []
    for _ in range(draw(st.integers(0, 6))):
        siblings = draw(st.lists(values, max_size=2))
        kind = draw(st.sampled_from(["list", "tuple", "dict", "keyed", "odict"]))
        at = draw(st.integers(0, len(siblings)))
        if kind in ("list", "tuple"):
            siblings.insert(at, value)
            value, key = (siblings if kind == "list" else tuple(siblings)), at
        else:
            keys = st.text(max_size=4) if kind == "dict" else hashables
            key = draw(keys)
            items = [(draw(keys), sibling) for sibling in siblings]
            # Not beside an equal key (1 == 1.0 == True), which would keep its own.
            items = [(k, v) for k, v in items if k != key]
            items.insert(min(at, len(items)), (key, value))
            value = OrderedDict(items) if kind == "odict" else dict(items)
        path.insert(0, key)
    return value, tuple(path)


def test_codec_refuses_unsupported_values_naming_their_key_path():
    with scenario("fuzz: state codec, unsupported values") as trials:

        @fuzz_settings(ci=100, long=2_000)
        @given(planted())
        @example(({1 << 20_000: [{1}]}, (1 << 20_000, 0)))
        def unsupported(case: tuple[Any, tuple[Any, ...]]) -> None:
            trials.count()
            value, path = case
            with pytest.raises(UnsupportedValueError) as raised:
                capture_state({"v": value})
            assert raised.value.path == format_path(("v", *path))
            trials.outcome("refused with its path")

        unsupported()


# -- hostile trees and bytes ------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_trees() -> list[Any]:
    """Trees as a save writes them: a training state's ($stateful, $rng, generators)
    with a leaf of every plain tag."""
    state = make_training_state()
    train_steps(state, 1)
    state["meta"]["odd"] = (
        {1: b"\x00", "b": 2, "a": None},
        OrderedDict(x=np.float16(0.5)),
        np.arange(4, dtype=">i2").reshape(2, 2),
        [float("-inf"), -0.0, 2**12_000, torch.int8, torch.device("cpu"), torch.Size([2])],
    )
    trees = [capture_state(state).tree]
    return [json.loads(dumps_canonical(tree)) for tree in trees]


def decodes_or_refuses(tree: Any, trials) -> None:
    trials.count()
    tensors = {"model/fc1.weight": torch.zeros(16, 8), "t": torch.zeros(2, dtype=torch.uint8)}
    outcome = measured(decode_tree, tree, tensors, "fuzz")
    size = len(render(tree))
    assert outcome.peak <= 64 * size + (4 << 20), f"decoding {size} bytes took {outcome.peak}"
    if outcome.error is not None:
        refused(trials, outcome.error)
    else:
        trials.outcome("decoded")


def test_codec_decoder_refuses_hostile_trees_with_typed_errors(saved_trees):
    trees = st.sampled_from(saved_trees)
    with scenario("fuzz: state codec decoder, hostile trees") as trials:

        @fuzz_settings(ci=200, long=5_000)
        @given(trees.flatmap(mutated_json) | st.dictionaries(st.text(max_size=4), hostile_json))
        def hostile(tree: Any) -> None:
            # The decoder meets what the canonical parser let through, never Raw text.
            try:
                data = render(tree).encode("utf-8", "surrogatepass")
                parsed = loads_canonical(data, "fuzz", max_depth=MAX_MANIFEST_DEPTH)
            except Exception as exc:
                trials.count()
                refused(trials, exc)
                return
            decodes_or_refuses(parsed, trials)

        hostile()


def test_codec_decoder_refuses_hostile_bytes_with_typed_errors(saved_trees):
    data = st.sampled_from([dumps_canonical(tree) for tree in saved_trees])
    with scenario("fuzz: state codec decoder, hostile bytes") as trials:

        @fuzz_settings(ci=150, long=5_000)
        @given(data.flatmap(mutated_bytes) | st.binary(max_size=64))
        def hostile(raw: bytes) -> None:
            try:
                parsed = loads_canonical(raw, "fuzz", max_depth=MAX_MANIFEST_DEPTH)
            except Exception as exc:
                trials.count()
                refused(trials, exc)
                return
            decodes_or_refuses(parsed, trials)

        hostile()
