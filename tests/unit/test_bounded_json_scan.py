"""The JSON pre-scan (``bounded_json.scan_json``) against a byte-by-byte reference.

The scan runs before ``json.loads`` on every document read from the store, to bound
its nesting depth and its longest number; it is vectorised per block and carries its
state (inside a string, depth, trailing backslashes and digits) from block to block.
Here small blocks put every boundary somewhere interesting, and random bytes of the
characters that matter exercise every path: brackets and digits inside and outside
strings, escaped quotes, runs of backslashes, numbers crossing blocks.
"""

from __future__ import annotations

import random

import pytest

from ckptvault.format import bounded_json

QUOTE, BACKSLASH = ord('"'), ord("\\")


def reference(data: bytes, max_depth: int, max_digits: int) -> set[str]:
    """What the scan must find, one byte at a time: a quote after an even run of
    backslashes opens or closes a string (the opening quote counts as inside);
    outside strings, brackets change the depth and digits make runs."""
    inside, backslashes, depth, run = False, 0, 0, 0
    found = set()
    for byte in data:
        if byte == QUOTE and backslashes % 2 == 0:
            inside = not inside
        backslashes = backslashes + 1 if byte == BACKSLASH else 0
        if inside:
            run = 0
            continue
        if byte in b"[{":
            depth += 1
            if depth > max_depth:
                found.add("deeper")
        elif byte in b"]}":
            depth -= 1
        run = run + 1 if 48 <= byte <= 57 else 0
        if run > max_digits:
            found.add("longer")
    return found


@pytest.mark.parametrize("block", [16, 64, 1 << 20])
def test_the_scan_agrees_with_a_byte_by_byte_reference(monkeypatch, block):
    max_digits = 9
    monkeypatch.setattr(bounded_json, "_BLOCK", block)
    monkeypatch.setattr(bounded_json, "_WINDOW", 4)  # 10 digits fill an aligned window
    monkeypatch.setattr(bounded_json, "MAX_INT_DIGITS", max_digits)
    rng = random.Random(block)
    alphabet = b'[]{}"\\0123456789a,: '
    refused = 0
    for _ in range(2000):
        weights = [rng.random() for _ in alphabet]
        data = bytes(rng.choices(alphabet, weights, k=rng.randint(0, 200)))
        if rng.random() < 0.3:
            data += b"7" * rng.randint(0, 2 * max_digits)
        max_depth = rng.randint(0, 8)
        expected = reference(data, max_depth, max_digits)
        got = bounded_json.scan_json(data, max_depth)
        if not expected:
            assert got is None, data
        else:
            refused += 1
            assert got is not None, data
            assert ("deeper" if "deeper than" in got else "longer") in expected, (data, got)
    assert refused > 200  # the refusals were exercised, not only the passes


def test_a_real_document_scans_clean_and_its_limits_hold():
    document = b'{"a":[1,2,{"b":"[[[[[\\"]]]"}],"n":' + b"9" * 4300 + b"}"
    assert bounded_json.scan_json(document, 3) is None
    assert "deeper than 2" in (bounded_json.scan_json(document, 2) or "")
    longer = document.replace(b"9" * 4300, b"9" * 4301)
    assert "longer than 4300 digits" in (bounded_json.scan_json(longer, 3) or "")
