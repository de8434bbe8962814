"""Fuzzing tensor files: ckptvault's writer and reader, and the header parser.

- Round trip: random tensors (every dtype a tensor file holds: bf16, fp16, the fp8
  kinds, complex, unsigned, bool; 0-d, empty and non-contiguous; arbitrary bytes, so
  NaN payloads and -0.0 too), saved by ``CheckpointManager`` with random chunk and
  encryption segment sizes, restore bit for bit, verify, and (plain files) read the
  same through stock ``safetensors``.
- Header parser: arbitrary bytes and byte- or JSON-level edits of real headers, with
  any claimed file size, are refused with ``FormatError`` or parse to entries that
  tile exactly the bytes the file has; never raw exceptions, never memory in
  proportion to what a header claims.
- Reader: a saved generation (format 3, and a planted format 2) whose tensor-file
  header was edited and whose manifest digests were rewritten to match (the root's
  file digest and the index's chunk digests; anyone who can write an unsigned store
  can) is refused with ``NoValidCheckpoint`` leaving the state untouched, or
  restores the very bytes that were saved. The rewrite is checked to reach the
  reader: the pristine header, resealed the same way, restores.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import load_file

import ckptvault as cv
from ckptvault.errors import NoValidCheckpoint
from ckptvault.format.tensorfile import (
    DTYPES,
    HEADER_LENGTH_BYTES,
    MAX_HEADER_BYTES,
    build_header,
    element_size,
    parse_header,
)
from ckptvault.storage import open_store
from ckptvault.trust.checks import verify_generation
from support.common import writable
from support.fuzzing import (
    Pairs,
    fuzz_settings,
    measured,
    mutated_bytes,
    mutated_json,
    refused,
    render,
    same_tensor,
    scenario,
)
from support.hostile_forging import forge_manifest, format_of, writer_format

pytestmark = [pytest.mark.fuzz, pytest.mark.reliability]

FILE_DTYPES = [getattr(torch, name) for name in sorted(DTYPES)]


@st.composite
def tensors(draw: st.DrawFn) -> torch.Tensor:
    """Arbitrary bytes as a tensor of any file dtype (bool: 0 or 1), any small shape;
    sometimes a transposed, non-contiguous view."""
    dtype = draw(st.sampled_from(FILE_DTYPES))
    shape = draw(st.lists(st.integers(0, 5), max_size=4))
    transposed = len(shape) >= 2 and draw(st.booleans())
    if transposed:
        shape[-1], shape[-2] = shape[-2], shape[-1]
    size = math.prod(shape) * dtype.itemsize
    raw = np.frombuffer(draw(st.binary(min_size=size, max_size=size)), dtype=np.uint8).copy()
    if dtype == torch.bool:
        raw &= 1
    flat = torch.empty(size, dtype=torch.uint8)
    if size:
        flat.copy_(torch.from_numpy(raw))
    tensor = flat.view(dtype).reshape(shape)
    return tensor.transpose(-1, -2) if transposed else tensor


tensor_dicts = st.dictionaries(st.text(min_size=1, max_size=10), tensors(), min_size=1, max_size=5)


def _fresh(tensors_by_name: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A destination state: the same names, dtypes and shapes, other bytes."""
    return {"t": {name: torch.zeros_like(t) for name, t in tensors_by_name.items()}}


def test_tensor_files_round_trip(tmp_path):
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    with scenario("fuzz: tensor files round trip") as trials:

        @fuzz_settings(ci=25, long=600)
        @given(
            tensor_dicts,
            st.sampled_from([1, 7, 64, 4096, 4 << 20]),
            st.none() | st.integers(1, 300),
        )
        def round_trip(saved: dict[str, torch.Tensor], chunk_size: int, segment: int | None):
            trials.count()
            store = Path(tempfile.mkdtemp(dir=root))
            options: dict[str, Any] = {"run_id": "fuzz", "chunk_size": chunk_size}
            if segment is not None:
                options.update(keystore=root / "keys", segment_size=segment)
            try:
                with cv.CheckpointManager(store, **options) as mgr:
                    path = Path(mgr.save(1, {"t": saved}).result().path)
                restored = _fresh(saved)
                with cv.CheckpointManager(store, **options) as mgr:
                    assert mgr.restore(restored) is not None
                for name, tensor in saved.items():
                    assert same_tensor(restored["t"][name], tensor), name
                source = open_store(str(store))
                (ref,) = source.list_generations()
                report = verify_generation(source, ref)
                assert report.ok, report.problems
                if segment is None:  # stock safetensors reads what was written
                    stock: dict[str, torch.Tensor] = {}
                    for file in path.glob("*.safetensors"):
                        stock.update(load_file(file))
                    assert stock.keys() == {f"t/{_escaped(name)}" for name in saved}
                    for name, tensor in saved.items():
                        assert same_tensor(stock[f"t/{_escaped(name)}"], tensor.contiguous())
            finally:
                shutil.rmtree(store, ignore_errors=True)
            trials.outcome("encrypted" if segment else "plain")

        round_trip()


def _escaped(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


# -- the header parser ------------------------------------------------------------------


@st.composite
def headers(draw: st.DrawFn) -> tuple[bytes, int]:
    """A header as the writer builds it, and the size of the file it heads."""
    layout = draw(
        st.lists(
            st.tuples(
                st.text(min_size=1, max_size=10).filter(lambda name: name != "__metadata__"),
                st.sampled_from(sorted(DTYPES)),
                st.lists(st.integers(0, 5), max_size=4).map(tuple),
            ),
            max_size=5,
            unique_by=lambda entry: entry[0],
        )
    )
    metadata = draw(st.sampled_from([{}, {"format": "pt", "writer": "ckptvault"}]))
    header = build_header(layout, metadata)
    end = max((entry.end for entry in header.entries.values()), default=header.data_start)
    return header.header_bytes, end


def _rewrapped(document: Any) -> bytes:
    """A JSON document as a header: padded to 8 bytes, with its length prefix."""
    text = render(document).encode("utf-8", "surrogatepass")
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


@st.composite
def hostile_headers(draw: st.DrawFn) -> tuple[bytes, int]:
    header, size = draw(headers())
    original = len(header)
    kind = draw(st.sampled_from(["bytes", "json", "json", "arbitrary"]))
    if kind == "bytes":
        header = draw(mutated_bytes(header))
    elif kind == "json":
        document = json.loads(header[HEADER_LENGTH_BYTES:])
        header = _rewrapped(draw(mutated_json(document)))
    else:
        header = draw(st.binary(max_size=64))
    # The size of the file it heads: what the (edited) header's entries need, near
    # that, or anything.
    shifted = max(0, size + len(header) - original)
    claim = draw(st.sampled_from(["fits", "fits", "near", "any"]))
    if claim == "near":
        return header, draw(st.integers(max(0, shifted - 16), shifted + 16))
    if claim == "any":
        return header, draw(st.integers(0, 2**64))
    return header, shifted


def check_parsed(header: bytes, file_size: int, trials) -> None:
    trials.count()
    outcome = measured(parse_header, header, file_size, "fuzz")
    assert outcome.peak <= 64 * len(header) + (4 << 20), f"{len(header)} bytes: {outcome.peak}"
    if outcome.error is not None:
        refused(trials, outcome.error)
        return
    parsed = outcome.value
    trials.outcome("accepted")
    # Accepted: the entries tile exactly the bytes between the header and the end.
    assert parsed.data_start == len(header) <= min(file_size, MAX_HEADER_BYTES)
    position = parsed.data_start
    for entry in sorted(parsed.entries.values(), key=lambda e: (e.start, e.end)):
        assert entry.start == position
        assert entry.nbytes == math.prod(entry.shape) * element_size(entry.dtype)
        position = entry.end
    assert position == file_size


def test_tensor_header_parser_refuses_hostile_headers():
    with scenario("fuzz: tensor-file header parser, hostile headers") as trials:

        @fuzz_settings(ci=200, long=10_000)
        @given(hostile_headers())
        def hostile(case: tuple[bytes, int]) -> None:
            check_parsed(*case, trials)

        hostile()


# -- the reader, behind rewritten digests -----------------------------------------------


@pytest.fixture(params=[3, 2], ids=["format-3", "format-2"])
def saved_generation(
    tmp_path: Path, request: pytest.FixtureRequest
) -> tuple[Path, Path, dict[str, torch.Tensor]]:
    """A plain generation of a few tensors of mixed dtypes, in one tensor file, in
    format 3 (root and index) or 2 (one manifest)."""
    torch.manual_seed(0)
    saved = {
        "w": torch.randn(3, 4),
        "h": torch.randn(5).to(torch.bfloat16),
        "n": torch.arange(6, dtype=torch.int64),
        "s": torch.tensor(2.5, dtype=torch.float64),
        "e": torch.zeros(0, 3, dtype=torch.float16),
        "m": torch.tensor([True, False]),
    }
    store = tmp_path / "store"
    with (
        writer_format(request.param),
        cv.CheckpointManager(store, run_id="fuzz", chunk_size=64) as mgr,
    ):
        generation = Path(mgr.save(1, {"t": saved}).result().path)
    return store, generation, saved


def test_tensor_file_reader_refuses_edited_headers_behind_rewritten_digests(saved_generation):
    store, generation, saved = saved_generation
    (file,) = generation.glob("*.safetensors")
    pristine = file.read_bytes()
    manifests = {p: p.read_bytes() for p in generation.glob("*.json")}  # root and indexes
    forge_manifest(generation)  # the rewrite alone reaches the reader: it restores
    state = _fresh(saved)
    with cv.CheckpointManager(store, run_id="fuzz", chunk_size=64) as mgr:
        assert mgr.restore(state).step == 1
    assert all(same_tensor(state["t"][name], tensor) for name, tensor in saved.items())
    (length,) = struct.unpack("<Q", pristine[:HEADER_LENGTH_BYTES])
    head, data = pristine[: HEADER_LENGTH_BYTES + length], pristine[HEADER_LENGTH_BYTES + length :]
    document = json.loads(head[HEADER_LENGTH_BYTES:])
    edits = st.one_of(
        mutated_bytes(head),
        mutated_json(document).map(_rewrapped),
        # Entries reordered or repeated: JSON-equal headers must not matter either.
        st.permutations(sorted(document.items())).map(lambda items: _rewrapped(Pairs(items))),
    )
    version = format_of(generation)
    name = f"fuzz: tensor-file reader, edited headers behind rewritten digests (format {version})"
    with scenario(name) as trials:

        @fuzz_settings(ci=25, long=1_000)
        @given(edits)
        def edited(new_head: bytes) -> None:
            trials.count()
            writable(file).write_bytes(new_head + data)
            forge_manifest(generation)
            state = _fresh(saved)
            try:
                with cv.CheckpointManager(store, run_id="fuzz", chunk_size=64) as mgr:
                    mgr.restore(state)
            except NoValidCheckpoint:
                assert all(not t.any() for t in state["t"].values()), "state was touched"
                trials.outcome("refused")
            except Exception as exc:
                refused(trials, exc)
                raise AssertionError(f"not NoValidCheckpoint: {exc!r}") from exc
            else:
                for name, tensor in saved.items():
                    assert same_tensor(state["t"][name], tensor), name
                trials.outcome("restored intact")
            finally:
                writable(file).write_bytes(pristine)
                for path, content in manifests.items():
                    writable(path).write_bytes(content)

        edited()
