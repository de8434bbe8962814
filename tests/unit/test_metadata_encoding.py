"""A first save writes its metadata a tensor at a time (issue 27, item 4): the bytes
must be exactly what encoding the whole documents wrote, so that every reader, every
signature and every older generation is unchanged.

Headers, the root's tensor table, an index's chunk list and a one-process layout's
index plan are compared with the straightforward encodings they replace, over names
JSON must escape, 0-d and empty tensors, grids and listed layouts.
"""

from __future__ import annotations

import json
import struct

import pytest
import torch

from ckptvault.errors import FormatError
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.index import encode_tensor_chunks
from ckptvault.format.index_plan import plan_indexes
from ckptvault.format.tensor_table import build_tensor_table
from ckptvault.format.tensorfile import DTYPES, build_header
from ckptvault.io.direct_write import layout_key, plan_layout
from ckptvault.io.writer import tensor_bytes

NAMES = ["w", 'quote"d', "back\\slash", "new\nline", "ctl\x01", "é/ü", "日本", "a b", "0"]
SHAPES = [(3, 4), (), (0, 5), (7,), (2, 1, 3)]


def reference_header(tensors, metadata) -> bytes:
    """The header as one json.dumps of the whole layout (the encoding replaced)."""
    layout: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape in tensors:
        code, size = DTYPES[dtype]
        nbytes = size
        for dim in shape:
            nbytes *= dim
        layout[name] = {
            "dtype": code,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(layout, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("metadata", [{}, {"format": "pt", "writer": "ckptvault"}])
def test_a_header_is_byte_for_byte_the_whole_layout_dumped(metadata):
    dtypes = ["float32", "bfloat16", "int64", "bool", "float16"]
    tensors = [
        (name, dtypes[i % len(dtypes)], SHAPES[i % len(SHAPES)]) for i, name in enumerate(NAMES)
    ]
    header = build_header(tensors, metadata)
    assert header.header_bytes == reference_header(tensors, metadata)
    assert [e.name for e in header.entries.values()] == NAMES
    with pytest.raises(FormatError, match="twice"):
        build_header([("w", "float32", (1,)), ("w", "float32", (1,))], {})


def dcp_section() -> dict:
    """Whole tensors, a grid of shards over 3 ranks, a listed layout and an empty one."""

    def chunk(offsets, sizes, rank):
        return {"offsets": offsets, "sizes": sizes, "file": f"r{rank:05d}-000.safetensors"}

    tensors = {
        name: {
            "dtype": "float32",
            "shape": list(shape),
            "chunks": [chunk([0] * len(shape), list(shape), 0)],
        }
        for name, shape in zip(NAMES, SHAPES * 2, strict=False)
    }
    tensors["grid"] = {
        "dtype": "bfloat16",
        "shape": [10, 4],
        "chunks": [chunk([0, 0], [4, 4], 0), chunk([4, 0], [4, 4], 1), chunk([8, 0], [2, 4], 2)],
    }
    tensors["listed"] = {
        "dtype": "int64",
        "shape": [4, 4],
        "chunks": [chunk([0, 0], [2, 2], 0), chunk([0, 2], [4, 2], 1), chunk([2, 0], [2, 2], 2)],
    }
    return tensors


def test_the_tensor_table_encodes_as_its_whole_document():
    from ckptvault.format.layout import file_holder

    table = build_tensor_table(dcp_section(), lambda name: file_holder(name) or 0)
    assert table.encoded() == dumps_canonical(table.to_json())
    assert table.to_json()["w"] == {"dtype": "float32", "shape": [3, 4], "holders": [[0, 1]]}


def test_an_index_chunk_list_encodes_as_its_whole_document():
    chunks = {
        name: [
            {
                "offsets": [0],
                "sizes": [i],
                "file": "r00000-000.safetensors",
                "name": name,
                "start": 8 * i,
                "length": 4 * i,
            },
        ]
        for i, name in enumerate(NAMES)
    }
    expected = dumps_canonical(
        {
            fqn: [
                [c["offsets"], c["sizes"], c["file"], c["name"], c["start"], c["length"]]
                for c in cs
            ]
            for fqn, cs in chunks.items()
        }
    )
    assert encode_tensor_chunks(chunks) == expected
    assert encode_tensor_chunks({}) == b"{}"


@pytest.mark.parametrize("encrypted", [False, True])
def test_a_one_process_layout_plans_its_index_as_its_dcp_section_would(encrypted):
    """The plan made straight from the layout (no dcp section built) is the plan made
    from the layout's dcp section: the same table, the same chunk list, byte for byte."""
    tensors = {
        name: torch.zeros(shape, dtype=(torch.float32, torch.bfloat16, torch.int8)[i % 3])
        for i, (name, shape) in enumerate(zip(NAMES, SHAPES * 2, strict=False))
    }
    tensors["big"] = torch.zeros(300_000)  # a second file
    layout = plan_layout(layout_key(tensors, 2, encrypted), 2, 0)
    assert len(layout.files) == 2
    reference = plan_indexes(layout.dcp_json, [f.name for f in layout.files])
    planned = layout.index_plan
    assert planned.holders == reference.holders == (0,)
    assert planned.tensors_members == reference.tensors_members
    assert planned.table.encoded() == reference.table.encoded()
    assert planned.table.to_json() == reference.table.to_json()


def test_canonical_json_still_refuses_what_has_no_canonical_form():
    assert dumps_canonical({"b": [1, None], "a": "é"}) == '{"a":"é","b":[1,null]}'.encode()
    for value in (float("nan"), "\ud800", {"k": float("inf")}):
        with pytest.raises(FormatError):
            dumps_canonical(value)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12.0).reshape(3, 4),
        torch.tensor(2.5),
        torch.zeros(0, 3),
        torch.tensor([True, False]),
        torch.randn(3, dtype=torch.complex64),
        torch.randn(3).to(torch.bfloat16),
        torch.arange(16.0).reshape(4, 4).t(),
        torch.randn(3, requires_grad=True),
        torch.arange(6, dtype=torch.int16)[::2],
    ],
    ids=lambda t: f"{t.dtype}-{list(t.shape)}",
)
def test_a_tensors_bytes_are_its_memory_in_order(tensor):
    expected = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    assert bytes(tensor_bytes(tensor)) == expected
