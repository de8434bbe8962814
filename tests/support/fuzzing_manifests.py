"""Valid manifests for the fuzz tests (``tests/reliability/test_fuzz_manifest.py``,
``tests/reliability/test_fuzz_index.py``): hypothesis strategies for every format the writer
produces (formats 1-2: one manifest; format 3: a root over indexes, its tensor table
built from random grid and listed layouts), and small hand-made ones of each format
with every optional section, where an edit lands on a field more often than on a
digest."""

from __future__ import annotations

import dataclasses
import itertools
import string
from datetime import datetime
from typing import Any

from hypothesis import strategies as st

from ckptvault.format.container import MAX_SEGMENT_SIZE
from ckptvault.format.index import IndexRecord
from ckptvault.format.layout import MAX_STEP, file_holder, index_file_name
from ckptvault.format.manifest import MAX_CHUNK_SIZE, Manifest, is_safe_file_name
from ckptvault.format.records import EncryptionSection, FileRecord
from ckptvault.format.tensor_table import build_tensor_table
from ckptvault.format.tensorfile import DTYPES
from support.fuzzing import json_scalars

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


rank_file_names = st.builds(
    lambda rank, rest: f"r{rank:05d}-{rest}", st.integers(0, 5), file_names
).filter(lambda name: is_safe_file_name(name) and not name.endswith("-index.json"))


@st.composite
def layouts(draw: st.DrawFn, holders: list[int]) -> dict[str, Any]:
    """A dcp tensor whose chunks (each in a file of one of ``holders``) are a grid of
    one dimension's parts, or one chunk, or two boxes that are no grid."""
    extent = draw(st.integers(1, 64))
    shape = [extent, draw(st.integers(0, 4))]
    cuts = sorted(draw(st.sets(st.integers(1, extent - 1), max_size=4))) if extent > 1 else []
    bounds = [0, *cuts, extent]
    boxes = [([a, 0], [b - a, shape[1]]) for a, b in itertools.pairwise(bounds)]
    if draw(st.booleans()) and extent > 1 and shape[1] > 1:
        boxes = [
            ([0, 0], [1, shape[1]]),
            ([1, 0], [extent - 1, 1]),
            ([1, 1], [extent - 1, shape[1] - 1]),
        ]
    return {
        "dtype": draw(st.sampled_from(sorted(DTYPES))),
        "shape": shape,
        "chunks": [
            {"offsets": o, "sizes": s, "file": f"r{draw(st.sampled_from(holders)):05d}-x"}
            for o, s in boxes
        ],
    }


@st.composite
def roots(draw: st.DrawFn) -> Manifest:
    """A format-3 root: files of a few ranks (each with the size and digest a root
    keeps), one index record per rank, and a tensor table built from random layouts."""
    manifest = draw(manifests())
    names = draw(st.lists(rank_file_names, unique=True, min_size=1, max_size=4))
    files = {name: FileRecord(draw(st.integers(0, 2**40)), draw(hex64), ()) for name in names}
    holders = sorted({file_holder(name) or 0 for name in names})
    indexes = {
        index_file_name(h): IndexRecord(draw(st.integers(1, 2**26)), draw(hex64)) for h in holders
    }
    tensors = draw(st.dictionaries(st.text(max_size=16), layouts(holders), max_size=3))
    table = build_tensor_table(tensors, lambda name: file_holder(name) or 0)
    encryption = draw(st.none() | encryption_sections(names))
    return dataclasses.replace(
        manifest,
        format_version=3,
        files=files,
        indexes=indexes,
        tensor_table=table,
        pending_indexes=frozenset(indexes),
        dcp={"version": draw(st.none() | st.text(max_size=6)), "tensors": {}},
        encryption=encryption,
    )


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


def _small_root() -> Manifest:
    """SMALL as a format-3 root over ranks 0 and 1: a tensor split in two rows (one
    cell each) and one of three boxes that are no grid."""

    def chunk(offsets: list[int], sizes: list[int], rank: int) -> dict[str, Any]:
        return {"offsets": offsets, "sizes": sizes, "file": f"r{rank:05d}-000.safetensors"}

    tensors = {
        "w": {
            "dtype": "bfloat16",
            "shape": [2, 3],
            "chunks": [chunk([0, 0], [1, 3], 0), chunk([1, 0], [1, 3], 1)],
        },
        "odd": {
            "dtype": "float32",
            "shape": [2, 2],
            "chunks": [
                chunk([0, 0], [1, 2], 1),
                chunk([1, 0], [1, 1], 0),
                chunk([1, 1], [1, 1], 1),
            ],
        },
    }
    files = {f"r{r:05d}-000.safetensors": FileRecord(5, str(r) * 64, ()) for r in (0, 1)}
    return dataclasses.replace(
        SMALL,
        format_version=3,
        files=files,
        dcp={"version": "1", "tensors": {}},
        indexes={index_file_name(r): IndexRecord(100 + r, str(r + 4) * 64) for r in (0, 1)},
        tensor_table=build_tensor_table(tensors, lambda name: file_holder(name) or 0),
        pending_indexes=frozenset(index_file_name(r) for r in (0, 1)),
        encryption=dataclasses.replace(
            SMALL.encryption, wrapped_keys={name: b"k" * 40 for name in files}
        )
        if SMALL.encryption
        else None,
    )


SMALL_ROOT = _small_root()
