"""The pickle-free JSON codec: every supported value round-trips exactly; anything
else is refused at save time with its key path."""

from __future__ import annotations

import math
from collections import OrderedDict, defaultdict
from enum import Enum

import numpy as np
import pytest
import torch

from ckptvault.errors import FormatError, UnsupportedValueError
from ckptvault.format.canonical import dumps_canonical, loads_canonical
from ckptvault.state.codec import Decoder, Encoder, format_path, tensor_key


def roundtrip(value):
    tensors = {}

    def sink(path, tensor):
        key = tensor_key(path)
        tensors[key] = tensor
        return key

    encoded = Encoder(sink).encode(value, ("v",))
    # Through canonical bytes, as in a manifest.
    encoded = loads_canonical(dumps_canonical(encoded), "test")
    return Decoder(tensors, "test").decode(encoded, ("v",))


def same(a, b) -> bool:
    """Exact equality that distinguishes types, -0.0 and NaN."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (
            a == b and math.copysign(1, a) == math.copysign(1, b)
        )
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and (a == b or (np.isnan(a) and np.isnan(b)))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        False,
        0,
        -7,
        2**64 + 1,
        -(2**200),
        10**5000,  # beyond CPython's int-to-str digit limit
        1.5,
        1e-310,
        float("inf"),
        float("-inf"),
        float("nan"),
        -0.0,
        0.0,
        "",
        'héllo \u2603 \n"quoted"',
        "$not-a-tag",
        [1, [2, [3]]],
        (1, (2.5, "x"), ()),
        {"b": 1, "a": 2},  # insertion order is kept
        {"$weird": 1, "plain": 2},
        {1: "int key", (1, 2): "tuple key", None: "none", 2.5: "float"},
        OrderedDict([("z", 1), ("a", 2)]),
        b"\x00\xffbytes",
        {"nested": {"lists": [{"deep": (float("nan"), -0.0)}]}},
        np.arange(12, dtype=np.uint32).reshape(3, 4),
        np.array([1.5, np.nan], dtype=np.float16),
        np.int64(-3),
        np.float32(0.25),
        np.bool_(True),
        torch.float16,
        torch.device("cpu"),
        torch.Size([2, 3]),
    ],
    ids=lambda v: type(v).__name__,
)
def test_values_roundtrip_exactly(value):
    assert same(roundtrip(value), value)


def test_tensors_become_references_with_path_keys():
    tensors = {}

    def sink(path, tensor):
        tensors[tensor_key(path)] = tensor
        return tensor_key(path)

    t = torch.arange(3)
    encoded = Encoder(sink).encode({"a/b": {"w": t}, "x~y": [t]}, ("meta",))
    assert encoded["a/b"]["w"] == {"$tensor": "meta/a~1b/w"}
    assert encoded["x~y"][0] == {"$tensor": "meta/x~0y/0"}
    assert set(tensors) == {"meta/a~1b/w", "meta/x~0y/0"}


class Color(Enum):
    RED = 1


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ({"ok": 1, "bad": lambda x: x}, "function"),
        ({"ok": [1, {2, 3}]}, "set"),
        ({"enum": Color.RED}, "Color"),
        ({"dd": defaultdict(int)}, "defaultdict"),
        ({"obj": object()}, "object"),
        ({"arr": np.array([object()])}, "object"),
        ({"sparse": torch.zeros(2, 2).to_sparse()}, "dense"),
    ],
)
def test_unsupported_values_name_their_key_path(value, fragment):
    with pytest.raises(UnsupportedValueError) as info:
        Encoder(lambda p, t: tensor_key(p)).encode(value, ("meta",))
    message = str(info.value)
    assert "state['meta']" in message
    assert fragment in message


def test_unsupported_value_path_is_exact():
    with pytest.raises(UnsupportedValueError) as info:
        Encoder(None).encode({"a": [0, {"b": {1, 2}}]}, ("meta",))
    assert info.value.path == "state['meta']['a'][1]['b']"
    assert format_path(("x", 0)) == "state['x'][0]"


def test_tensor_refused_where_no_tensor_sink():
    with pytest.raises(UnsupportedValueError):
        Encoder(None).encode({"t": torch.ones(1)}, ("contract",))


@pytest.mark.parametrize(
    "encoded",
    [
        {"$eval": "__import__('os')"},
        {"$float": "nan", "extra": 1},
        {"$tensor": "nope"},
        {"$ndarray": {"dtype": "|O", "shape": [1], "data": ""}},
        {"$torch_dtype": "not_a_dtype"},
    ],
)
def test_decoder_refuses_unknown_or_malformed_tags(encoded):
    with pytest.raises(FormatError):
        Decoder({}, "test").decode(encoded, ())


def test_canonical_json_is_strict():
    data = dumps_canonical({"b": [1, 2.5], "a": "ü"})
    assert data == '{"a":"ü","b":[1,2.5]}'.encode()
    with pytest.raises(FormatError, match="canonical"):
        loads_canonical(b'{"b": 1, "a": 2}', "manifest")
    with pytest.raises(FormatError):
        loads_canonical(b'{"a":NaN}', "manifest")
    with pytest.raises(FormatError):
        loads_canonical(b"\xff\xfe", "manifest")


def test_two_nan_keys_stay_two_keys():
    # Found by fuzzing (tests/reliability/test_fuzz_codec.py): the decoder returned one shared NaN
    # object for every {"$float": "nan"}, so a saved dict with two NaN keys (two keys in
    # Python: NaN equals nothing) read back as one key twice and the generation was
    # refused as malformed.
    value = {float("nan"): 1, float("nan"): 2}
    restored = roundtrip(value)
    assert len(restored) == 2 and all(math.isnan(k) for k in restored)
    assert list(restored.values()) == [1, 2]
    assert len(roundtrip(OrderedDict([((math.nan,), 1), ((float("nan"),), 2)]))) == 2


def test_key_paths_through_huge_int_keys_are_named():
    # Found by fuzzing: a dict key past CPython's 4300-digit int->str limit made
    # naming the key path (a tensor's flat name, an error message) raise a raw
    # ValueError; it is spelled in hex instead.
    huge = 1 << 20_000
    assert roundtrip({huge: torch.zeros(1)})[huge].shape == (1,)
    with pytest.raises(UnsupportedValueError) as info:
        Encoder(None).encode({huge: [{1, 2}], (1, huge): 0}, ("meta",))
    assert info.value.path == f"state['meta'][{hex(huge)}][0]"
    assert tensor_key(("m", (huge, "a/b"), huge)) == f"m/({hex(huge)}, 'a~1b')/{hex(huge)}"
    assert format_path(((1,), (), 2)) == "state[(1,)][()][2]"
    with pytest.raises(FormatError, match=hex(huge)[:20]):
        Decoder({}, "test").decode({"$dict": [[{"$bigint": hex(huge)}, {"$float": "x"}]]}, ())
