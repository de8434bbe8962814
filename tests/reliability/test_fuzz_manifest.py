"""Fuzzing manifest parsing (``parse_manifest``), the first parser a restore, export
or ``verify`` runs on bytes from the store.

- Round trip: any manifest the writer can build (formats 1-2: one manifest; format
  3: a root over indexes, with a tensor table of grids and listed layouts) encodes
  to bytes that parse back to an equal manifest, and re-encode to the same bytes.
- Hostile bytes: arbitrary bytes, byte-level edits of real and generated manifests
  and roots, and JSON-level edits (other types, huge and boundary numbers, nasty
  strings, raw text no encoder writes, deep nesting, duplicate keys), resealed with a
  correct self-digest as anyone who can write the store can, either parse to a
  manifest that says exactly what the bytes say (a format-3 root: byte for byte what
  it would write back), or are refused with a ckptvault error; never a raw
  exception, never memory out of proportion to the input.

The index parser and the tensor table are fuzzed in ``test_fuzz_index.py`` and
``test_fuzz_tensor_table.py``.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from blake3 import blake3
from hypothesis import given
from hypothesis import strategies as st

import ckptvault as cv
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.manifest import (
    SELF_DIGEST_KEY,
    Manifest,
    parse_manifest,
)
from support.common import make_training_state, train_steps
from support.fuzzing import (
    fuzz_settings,
    measured,
    mutated_bytes,
    mutated_json,
    refused,
    render,
    scenario,
)
from support.fuzzing_manifests import SMALL, SMALL_ROOT, manifests, roots
from support.hostile_forging import writer_format

pytestmark = [pytest.mark.fuzz, pytest.mark.reliability]


def test_manifest_round_trip():
    with scenario("fuzz: manifest round trip") as trials:

        @fuzz_settings(ci=100, long=3_000)
        @given(manifests() | roots())
        def round_trip(manifest: Manifest) -> None:
            trials.count()
            data = manifest.to_bytes()
            parsed = parse_manifest(data, "fuzz")
            assert parsed == manifest
            assert parsed.to_json() == manifest.to_json()  # the tensor table too
            assert parsed.to_bytes() == data
            trials.outcome(f"round-tripped, format {manifest.format_version}")

        round_trip()


# -- hostile bytes ----------------------------------------------------------------------


def _wrapped(encoded: str) -> str:
    """A wrapped key as the parser keeps it: decoded, and written back by to_json."""
    return base64.b64encode(base64.b64decode(encoded, validate=True)).decode("ascii")


_KEPT_AS_IS = ("format_version", "run_id", "step", "generation_id", "created_at", "parent")
_KEPT_AS_IS += ("chunk_size", "dcp", "state", "contract", "writer")


def _projection(raw: dict[str, Any]) -> dict[str, Any]:
    """What an accepted document says, in the fields a Manifest keeps: unknown keys,
    absent optional sections and base64 spellings are what a parse may drop."""
    document = {key: raw.get(key) for key in _KEPT_AS_IS}
    document["files"] = {
        name: {key: record[key] for key in ("size", "blake3", "chunks")}
        for name, record in raw["files"].items()
    }
    section = raw.get("encryption")
    if section is not None:
        kept = {key: section[key] for key in ("cipher", "kek_id", "segment_size")}
        kept["files"] = {
            n: {"wrapped_key": _wrapped(e["wrapped_key"])} for n, e in section["files"].items()
        }
        if section.get("wrapped_mac_key") is not None:
            kept["wrapped_mac_key"] = _wrapped(section["wrapped_mac_key"])
            kept["manifest_mac"] = section["manifest_mac"]
        document["encryption"] = kept
    if raw.get("metrics") is not None:
        document["metrics"] = raw["metrics"]
    return document


def check_hostile(data: bytes, trials) -> None:
    """The property every byte string must satisfy (see the module docstring)."""
    trials.count()
    outcome = measured(parse_manifest, data, "fuzz")
    # Linear in the input (json.loads builds ~20 bytes of objects per byte at worst).
    assert outcome.peak <= 64 * len(data) + (4 << 20), f"{len(data)} bytes took {outcome.peak}"
    if outcome.error is not None:
        refused(trials, outcome.error)
        return
    manifest = outcome.value
    trials.outcome(f"accepted, format {manifest.format_version}")
    raw = json.loads(data)
    if manifest.indexed:
        # A root is accepted only in the form it would be written back in.
        assert manifest.to_bytes() == data
        raw.pop(SELF_DIGEST_KEY)
        assert dumps_canonical(manifest.to_json()) == dumps_canonical(raw)
        return
    # What was accepted is a manifest that says exactly what its bytes say ...
    projection = dumps_canonical(_projection(raw))
    assert dumps_canonical(manifest.to_json()) == projection
    # ... stable under re-encoding, and byte-identical when nothing was dropped.
    again = manifest.to_bytes()
    assert parse_manifest(again, "fuzz") == manifest
    raw.pop(SELF_DIGEST_KEY)
    if dumps_canonical(raw) == projection:
        assert again == data


def sealed(document: object) -> bytes:
    """``document`` with a correct self-digest (when it is an object): what anyone who
    can write the store can produce, so that edits reach the checks behind it."""
    if type(document) is not dict:
        return render(document).encode("utf-8", "surrogatepass")
    body = {key: value for key, value in document.items() if key != SELF_DIGEST_KEY}
    digest = blake3(render(body).encode("utf-8", "surrogatepass")).hexdigest()
    return render({**body, SELF_DIGEST_KEY: digest}).encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def base_manifests(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """Starting points: roots from the real writer (a plain run's first and second
    generation, an encrypted run's), format-2 manifests from it, and a small one of
    each format with every optional section (the root's table a grid over two ranks
    and a listed layout), where an edit lands on a field more often than on a digest."""
    root = tmp_path_factory.mktemp("fuzz-manifests")
    found = [SMALL.to_bytes(), SMALL_ROOT.to_bytes()]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_STATE_HOME", str(root / "state"))
        for encrypted, version in ((False, 3), (True, 3), (False, 2), (True, 2)):
            store = root / f"store-{encrypted}-{version}"
            extra = {"keystore": root / "keys", "segment_size": 4096} if encrypted else {}
            state = make_training_state()
            state["meta"]["odd"] = (float("nan"), -0.0, 2**70, b"\x00", {3: "x"})
            state["weights"] = {"bf16": torch.ones(3, dtype=torch.bfloat16)}
            with writer_format(version), cv.CheckpointManager(store, run_id="fuzz", **extra) as mgr:
                for step in (1, 2) if not encrypted else (1,):
                    train_steps(state, 1)
                    path = Path(mgr.save(step, state, metrics={"loss": 0.5}).result().path)
                    found.append((path / "manifest.json").read_bytes())
    for data in found:
        parse_manifest(data, "fixture")  # the starting points are valid
    return found


def test_manifest_parser_refuses_hostile_bytes_with_typed_errors(base_manifests):
    bases = st.sampled_from(base_manifests)
    inputs = st.one_of(
        st.binary(max_size=256),
        bases.flatmap(mutated_bytes),
        bases.flatmap(lambda data: mutated_json(json.loads(data)).map(sealed)),
    )
    with scenario("fuzz: manifest parser, hostile bytes") as trials:

        @fuzz_settings(ci=300, long=10_000)
        @given(inputs)
        def hostile(data: bytes) -> None:
            check_hostile(data, trials)

        hostile()
