"""Shared pieces of the property-based fuzz tests (``tests/reliability/test_fuzz_*.py``).

Each fuzz test runs one or more hypothesis properties inside :func:`scenario`, which
counts the examples the property body actually ran and records them in the
reliability log (``tests/support/reliability.py``), with a failure when hypothesis found a
counterexample (it then re-raises, so the test fails with hypothesis's report).

Budgets: :func:`fuzz_settings` takes the CI and the long example counts. Under
``make test`` the examples are derandomized (the same ones every run, so a green CI
stays green until the code changes) and no example database is used; under
``make fuzz`` / ``make reliability`` (``CKPTVAULT_RELIABILITY_LONG=1``) they are
random and failures are stored in ``.hypothesis/`` (git-ignored) and replayed first on
the next run. A failure prints the falsifying example and a ``@reproduce_failure``
blob; ``pytest --hypothesis-seed=N`` replays a whole long run.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from ckptvault.errors import CheckpointError
from support.reliability import budget, long_run, record


def fuzz_settings(ci: int, long: int) -> settings:
    """Hypothesis settings for one property: ``ci`` examples in ``make test``,
    ``long`` in the long run. No deadline: on a loaded 2-core machine an example's
    time says nothing about the code; inputs whose size could make the code slow are
    bounded by the strategies, and the slow-input tests time themselves."""
    options: dict[str, object] = {}
    if not long_run():
        options["database"] = None
    return settings(
        max_examples=budget(ci, long),
        deadline=None,
        derandomize=not long_run(),
        print_blob=True,
        # Examples that save and restore a checkpoint take ~0.1 s each; that is the
        # point of them, not a slow strategy. Mutated inputs are often large.
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        **options,  # type: ignore[arg-type]
    )


@dataclass
class Trials:
    """Counts a property's executed examples (shrinking and replays included)."""

    examples: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)

    def count(self) -> None:
        self.examples += 1

    def outcome(self, kind: str) -> None:
        """Tally what an example ended in (accepted, refused with which error...)."""
        self.outcomes[kind] = self.outcomes.get(kind, 0) + 1

    def summary(self) -> str:
        return ", ".join(f"{kind} {n}" for kind, n in sorted(self.outcomes.items()))


@contextlib.contextmanager
def scenario(name: str) -> Iterator[Trials]:
    """Record ``name``'s examples and whether hypothesis found a failure."""
    trials = Trials()
    began = time.monotonic()
    try:
        yield trials
    except BaseException:
        record(name, trials.examples, 1, f"falsified; {trials.summary()}")
        raise
    detail = f"{time.monotonic() - began:.0f} s; {trials.summary()}"
    record(name, trials.examples, 0, detail)
    assert trials.examples > 0, f"{name}: hypothesis ran no example"


def refused(trials: Trials, exc: BaseException) -> None:
    """An input was refused: it must have been with a ckptvault error (re-raised
    otherwise, so hypothesis reports the raw exception and the input)."""
    if not isinstance(exc, CheckpointError):
        raise exc
    trials.outcome(type(exc).__name__)


@dataclass
class Outcome:
    """What one call returned or raised, and the most memory it held at once."""

    value: Any
    error: Exception | None
    peak: int


def measured(function: Callable[..., Any], *args: Any) -> Outcome:
    """Call ``function``, catching what it raises, with Python's and NumPy's
    allocations traced only for the call (tracing the whole property, generation
    included, would make it five times slower)."""
    already = tracemalloc.is_tracing()
    if already:
        tracemalloc.reset_peak()
    else:
        tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    try:
        value, error = function(*args), None
    except Exception as exc:  # the caller decides: refused() or a failed property
        value, error = None, exc
    finally:
        peak = tracemalloc.get_traced_memory()[1] - base
        if not already:
            tracemalloc.stop()
    return Outcome(value, error, peak)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical: the same dtype, shape and bytes (NaN payloads, -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(
        a.detach().contiguous().reshape(-1).view(torch.uint8),
        b.detach().contiguous().reshape(-1).view(torch.uint8),
    )


# -- byte-level mutations --------------------------------------------------------------

_OPS = ("flip", "set", "insert", "delete", "truncate", "extend", "duplicate", "swap")


@st.composite
def mutated_bytes(draw: st.DrawFn, base: bytes, max_ops: int = 4) -> bytes:
    """``base`` with 1..``max_ops`` random edits: bit flips, byte sets, insertions,
    deletions, truncation, extension, a duplicated span, two spans swapped."""
    data = bytearray(base)
    for _ in range(draw(st.integers(1, max_ops))):
        op = draw(st.sampled_from(_OPS))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[at : at + draw(st.integers(1, 16))]
        elif op == "truncate":
            del data[at:]
        elif op == "extend":
            data += draw(st.binary(min_size=1, max_size=64))
        elif op == "duplicate":
            span = bytes(data[at : at + draw(st.integers(1, 64))])
            data[at:at] = span
        elif op == "swap" and len(data) > 1:
            first, second = sorted((min(at, len(data) - 1), draw(st.integers(0, len(data) - 1))))
            size = min(draw(st.integers(1, 32)), second - first, len(data) - second)
            if size > 0:
                a, b = bytes(data[first : first + size]), bytes(data[second : second + size])
                data[first : first + size], data[second : second + size] = b, a
    return bytes(data)


# -- JSON-level mutations --------------------------------------------------------------


class Raw(str):
    """JSON text spliced verbatim by :func:`render`: what ``json.dumps`` never writes."""


class Pairs(list):  # type: ignore[type-arg]
    """A JSON object written as these ``(key, value)`` pairs, in order; keys may repeat."""


def render(value: object) -> str:
    """``value`` as canonical JSON text (sorted keys, no whitespace, UTF-8 as is),
    with :class:`Raw` spliced verbatim and :class:`Pairs` written as given."""
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, Pairs):
        return "{" + ",".join(f"{render(str(k))}:{render(v)}" for k, v in value) + "}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{render(str(k))}:{render(value[k])}" for k in sorted(value)) + "}"
    if isinstance(value, list):
        return "[" + ",".join(render(item) for item in value) + "]"
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


# Text no ckptvault writer produces: numbers JSON readers disagree on or choke on, lone
# surrogates, nesting past every bound, spellings canonical JSON does not use.
RAW_TOKENS = (
    "1" + "0" * 4400,
    "-" + "9" * 4301,
    "9" * 4300,
    "1e999",
    "-1e999",
    "1e-999",
    "NaN",
    "Infinity",
    "-Infinity",
    "-0",
    "1E5",
    "1.0e+2",
    "01",
    "1.",
    ".5",
    "+1",
    "0x10",
    "tru",
    "nul",
    '"\\ud800"',
    '"\\udfff\\ud800"',
    '"a\\ud83d"',
    '"\\u0000"',
    '"\\u00e9"',
    '"\\/"',
    '"unterminated',
    "[" * 200 + "]" * 200,
    '{"a":' * 140 + "0" + "}" * 140,
    "[" * 100_000,
    " 1",
    "1 ",
    "[1,]",
    '{"a":1,}',
    "\ufeff1",
)

NASTY_STRINGS = (
    "",
    ".",
    "..",
    "../x",
    "/etc/passwd",
    "a/../b",
    "manifest.json",
    "manifest.sig",
    ".hidden",
    "a" * 300,
    "\u202eevil",
    "\x00",
    "\n",
    "é",
    "😀",
    "\u2028",
    "$tuple",
    "$tensor",
    "$bigint",
    "__metadata__",
    "r00000-000.safetensors",
    "AES-256-GCM",
    "20240101T000000000000Z-0000000g",
)

NASTY_NUMBERS = (
    0,
    -1,
    1,
    2,
    255,
    256,
    2**31,
    2**32,
    2**53 + 1,
    2**62,
    2**62 + 1,
    2**63 - 1,
    2**63,
    -(2**63),
    2**64,
    1 << 30,
    (1 << 30) + 1,
    64 * 1024 * 1024,
    64 * 1024 * 1024 + 1,
    10**4299,
    0.0,
    -0.0,
    0.5,
    1.0,
    1e308,
    5e-324,
    True,
    False,
)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**200), max_value=2**200),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(NASTY_NUMBERS),
    st.sampled_from(NASTY_STRINGS),
)
hostile_scalars = st.one_of(json_scalars, st.sampled_from(RAW_TOKENS).map(Raw))
hostile_json = st.recursive(
    hostile_scalars,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.text(max_size=6) | st.sampled_from(NASTY_STRINGS), inner, max_size=3)
    ),
    max_leaves=8,
)
hostile_keys = st.text(max_size=10) | st.sampled_from(NASTY_STRINGS)


def _nudged(draw: st.DrawFn, value: object) -> object:
    """A value near ``value``: off by one, another type for the same number, ..."""
    if type(value) is int:
        return draw(
            st.sampled_from(
                [value + 1, value - 1, -value, value * 2, value + 2**64, str(value)]
                + ([float(value)] if abs(value) < 2**1000 else [])
            )
        )
    if type(value) is str:
        return draw(
            st.sampled_from(
                [value[:-1], value + "0", value.upper(), value[::-1], " " + value, [value]]
            )
        )
    if type(value) is list:
        return draw(st.sampled_from([value[:-1], value + value[-1:], value[::-1], {"0": value}]))
    if type(value) is dict:
        return draw(st.sampled_from([list(value.values()), {**value, "": None}, {}]))
    return draw(hostile_json)


def _mutate_once(draw: st.DrawFn, root: object) -> object:
    """One edit at a random place of the document; returns the (new) root."""
    parent: dict[object, object] | list[object] | None = None
    key: object = None
    node = root
    # Below the root (rarely worth replacing whole), descend with probability 3/4 a
    # level: deep fields get edited too.
    while type(node) in (dict, list) and node and (parent is None or draw(st.integers(0, 3))):
        assert isinstance(node, (dict, list))
        parent = node
        key = draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        node = node[key]  # type: ignore[index]
    op = draw(st.sampled_from(("replace", "nudge", "delete", "add", "duplicate", "rename")))
    if op == "replace":
        new: object = draw(hostile_json)
    elif op == "nudge":
        new = _nudged(draw, node)
    elif op == "add" and type(node) is dict:
        new = {**node, draw(hostile_keys): draw(hostile_json)}
    elif op == "add" and type(node) is list:
        new = [*node]
        new.insert(draw(st.integers(0, len(node))), draw(hostile_json))
    elif op == "duplicate" and type(node) is dict and node:
        pairs = sorted(node.items())
        twin = draw(st.integers(0, len(pairs) - 1))
        value = draw(st.one_of(st.just(pairs[twin][1]), hostile_json))
        pairs.insert(draw(st.integers(0, len(pairs))), (pairs[twin][0], value))
        new = Pairs(pairs)
    elif op == "rename" and type(node) is dict and node:
        old = draw(st.sampled_from(sorted(node)))
        new = {k: v for k, v in node.items() if k != old}
        new[draw(hostile_keys)] = node[old]
    elif op == "delete" and parent is not None:
        del parent[key]  # type: ignore[arg-type]
        return root
    else:
        new = draw(hostile_json)
    if parent is None:
        return new
    parent[key] = new  # type: ignore[index]
    return root


@st.composite
def mutated_json(draw: st.DrawFn, document: object, max_ops: int = 3) -> object:
    """A deep copy of ``document`` with 1..``max_ops`` JSON-level edits: values
    replaced by other types, huge or boundary numbers, nasty strings, raw text no
    encoder writes, deep nesting; keys deleted, added, renamed or duplicated."""
    root = copy.deepcopy(document)
    for _ in range(draw(st.integers(1, max_ops))):
        root = _mutate_once(draw, root)
    return root
