"""Fuzzing manifest parsing (``parse_manifest``), the first parser a restore, export
or ``verify`` runs on bytes from the store.

- Round trip: any manifest the writer can build encodes to bytes that parse back to
  an equal manifest, and re-encode to the same bytes.
- Hostile bytes: arbitrary bytes, byte-level edits of real and generated manifests,
  and JSON-level edits (other types, huge and boundary numbers, nasty strings, raw
  text no encoder writes, deep nesting, duplicate keys), resealed with a correct
  self-digest as anyone who can write the store can, either parse to a manifest that
  says exactly what the bytes say, or are refused with a ckptvault error; never a
  raw exception, never memory out of proportion to the input.
"""

from __future__ import annotations

import base64
import json
import string
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from blake3 import blake3
from hypothesis import given
from hypothesis import strategies as st

import ckptvault as cv
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.container import MAX_SEGMENT_SIZE
from ckptvault.format.layout import MAX_STEP
from ckptvault.format.manifest import (
    MAX_CHUNK_SIZE,
    SELF_DIGEST_KEY,
    Manifest,
    is_safe_file_name,
    parse_manifest,
)
from ckptvault.format.records import EncryptionSection, FileRecord
from ckptvault.format.tensorfile import DTYPES
from conftest import make_training_state, train_steps
from fuzzing import (
    fuzz_settings,
    json_scalars,
    measured,
    mutated_bytes,
    mutated_json,
    refused,
    render,
    scenario,
)

pytestmark = [pytest.mark.fuzz, pytest.mark.reliability]

# -- valid manifests --------------------------------------------------------------------

hex64 = st.binary(min_size=32, max_size=32).map(bytes.hex)
generation_ids = st.builds(
    lambda moment, suffix: f"{moment:%Y%m%dT%H%M%S%f}Z-{suffix}",
    st.datetimes(min_value=datetime(1000, 1, 1)),
    st.text("0123456789abcdef", min_size=8, max_size=8),
)
ALNUM = string.ascii_letters + string.digits
file_names = st.builds(  # what manifests name: r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}", no ".."
    str.__add__, st.sampled_from(ALNUM), st.text(ALNUM + "._-", max_size=40)
).filter(is_safe_file_name)
plain_json = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
json_objects = st.dictionaries(st.text(max_size=8), plain_json, max_size=3)


@st.composite
def file_records(draw: st.DrawFn, chunk_size: int) -> FileRecord:
    chunks = draw(st.integers(0, 5))
    size = draw(st.integers(max((chunks - 1) * chunk_size + 1, 0), chunks * chunk_size))
    return FileRecord(
        size, draw(hex64), tuple(draw(st.lists(hex64, min_size=chunks, max_size=chunks)))
    )


@st.composite
def dcp_sections(draw: st.DrawFn, files: list[str]) -> dict[str, Any]:
    counts = st.integers(0, 2**40)
    chunk = st.fixed_dictionaries(
        {
            "offsets": st.lists(counts, max_size=4),
            "sizes": st.lists(counts, max_size=4),
            "file": st.sampled_from(files) if files else st.text(max_size=8),
            "name": st.text(max_size=16),
            "start": counts,
            "length": counts,
        }
    )
    tensor = st.fixed_dictionaries(
        {
            "dtype": st.sampled_from(sorted(DTYPES)),
            "shape": st.lists(st.integers(0, 4096), max_size=4),
            "chunks": st.lists(chunk, max_size=2),
        }
    )
    return {
        "version": draw(st.text(max_size=6)),
        "tensors": draw(st.dictionaries(st.text(max_size=16), tensor, max_size=2)),
    }


@st.composite
def encryption_sections(draw: st.DrawFn, files: list[str]) -> EncryptionSection:
    keyed = draw(st.lists(st.sampled_from(files), unique=True)) if files else []
    authenticated = draw(st.booleans())
    return EncryptionSection(
        cipher=draw(st.text(max_size=12)),
        kek_id=draw(st.text(max_size=12)),
        segment_size=draw(st.integers(1, MAX_SEGMENT_SIZE)),
        wrapped_keys={name: draw(st.binary(max_size=80)) for name in keyed},
        wrapped_mac_key=draw(st.binary(max_size=80)) if authenticated else None,
        manifest_mac=draw(hex64) if authenticated else None,
    )


metrics = st.dictionaries(
    st.builds(
        str.__add__,
        st.sampled_from("_" + string.ascii_letters),
        st.text(ALNUM + "_.:/-", max_size=20),
    ),
    st.integers(-(2**63) + 1, 2**63 - 1) | st.floats(allow_nan=False, allow_infinity=False),
    max_size=4,
)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    chunk_size = draw(st.integers(1, 64) | st.integers(1, MAX_CHUNK_SIZE))
    names = draw(st.lists(file_names, unique=True, max_size=3))
    files = {name: draw(file_records(chunk_size)) for name in names}
    return Manifest(
        format_version=draw(st.sampled_from([1, 2])),
        run_id=draw(st.text(max_size=20)),
        step=draw(st.integers(0, MAX_STEP)),
        generation_id=draw(generation_ids),
        created_at=draw(st.text(max_size=30)),
        parent=draw(st.none() | generation_ids),
        chunk_size=chunk_size,
        files=files,
        dcp=draw(dcp_sections(names)),
        state=draw(json_objects),
        contract=draw(json_objects),
        writer=draw(json_objects),
        encryption=draw(st.none() | encryption_sections(names)),
        metrics=draw(st.none() | metrics),
    )


def test_manifest_round_trip():
    with scenario("fuzz: manifest round trip") as trials:

        @fuzz_settings(ci=100, long=3_000)
        @given(manifests())
        def round_trip(manifest: Manifest) -> None:
            trials.count()
            data = manifest.to_bytes()
            parsed = parse_manifest(data, "fuzz")
            assert parsed == manifest
            assert parsed.to_bytes() == data
            trials.outcome("round-tripped")

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
    trials.outcome("accepted")
    # What was accepted is a manifest that says exactly what its bytes say ...
    raw = json.loads(data)
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


SMALL = Manifest(
    format_version=1,
    run_id="r",
    step=7,
    generation_id="20240101T000000000000Z-0123abcd",
    created_at="2024-01-01T00:00:00.000000Z",
    parent="20231231T235959999999Z-89abcdef",
    chunk_size=4,
    files={"a.safetensors.enc": FileRecord(5, "0" * 64, ("1" * 64, "2" * 64))},
    dcp={
        "version": "1",
        "tensors": {
            "w": {
                "dtype": "bfloat16",
                "shape": [2],
                "chunks": [
                    {
                        "offsets": [0],
                        "sizes": [2],
                        "file": "a.safetensors.enc",
                        "name": "w",
                        "start": 1,
                        "length": 4,
                    }
                ],
            }
        },
    },
    state={"meta": {"$tuple": [1, {"$float": "nan"}]}},
    contract={"dataset": "d"},
    writer={"world_size": 1},
    encryption=EncryptionSection(
        "AES-256-GCM", "k1", 4096, {"a.safetensors.enc": b"k" * 40}, b"m" * 40, "3" * 64
    ),
    metrics={"loss": 0.25, "n": 3},
)


@pytest.fixture(scope="module")
def base_manifests(tmp_path_factory: pytest.TempPathFactory) -> list[bytes]:
    """Starting points: manifests from the real writer (a plain run's first and
    second generation, an encrypted run's), and a small one with every optional
    section, where an edit lands on a field more often than on a digest."""
    root = tmp_path_factory.mktemp("fuzz-manifests")
    found = [SMALL.to_bytes()]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_STATE_HOME", str(root / "state"))
        for encrypted in (False, True):
            store = root / f"store-{encrypted}"
            extra = {"keystore": root / "keys", "segment_size": 4096} if encrypted else {}
            state = make_training_state()
            state["meta"]["odd"] = (float("nan"), -0.0, 2**70, b"\x00", {3: "x"})
            state["weights"] = {"bf16": torch.ones(3, dtype=torch.bfloat16)}
            with cv.CheckpointManager(store, run_id="fuzz", **extra) as mgr:
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
