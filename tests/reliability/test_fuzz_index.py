"""Fuzzing format 3's per-rank indexes: their parser
(``ckptvault.format.index.parse_index``) and the loader that checks them against the
root (``ckptvault.trust.indexes.load_indexes``), which every format-3 restore,
export and ``verify`` runs on bytes from the store.

- Hostile index bytes: arbitrary bytes, byte-level edits of real indexes and
  JSON-level edits (other types, huge and boundary numbers, nasty strings, raw text
  no encoder writes, deep nesting, duplicate keys) are refused with a ckptvault
  error, or parse to contents that say exactly what the bytes say; never a raw
  exception, never memory out of proportion to the input.
- Behind rewritten digests: a root or an index of a real generation (one rank as
  the writer wrote it; two ranks with a tensor split in rows and one listed as
  boxes that are no grid) edited, and every digest that covers it recomputed as
  anyone who can write the store can (the index's record in the root, the root's
  self-digest). Whatever is not refused by the root's parser or the file-set check
  is refused by ``load_indexes`` with a ckptvault error, or loads indexes whose
  chunks are exactly the cells the root's tensor table gives each, with chunk
  digests for every file, alike when the indexes are loaded one at a time.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from blake3 import blake3
from hypothesis import given
from hypothesis import strategies as st

import ckptvault as cv
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.index import parse_index
from ckptvault.format.layout import GenerationName, file_holder
from ckptvault.format.manifest import SELF_DIGEST_KEY, parse_manifest
from ckptvault.storage.base import GenerationRef
from ckptvault.trust.chunk_layout import tiling_problem
from ckptvault.trust.indexes import load_indexes
from support.common import make_training_state, writable
from support.forging import read_logical, write_logical
from support.fuzzing import (
    fuzz_settings,
    measured,
    mutated_bytes,
    mutated_json,
    refused,
    render,
    scenario,
)
from support.tensor_cells import expanded

pytestmark = [pytest.mark.fuzz, pytest.mark.reliability]

MANIFEST = "manifest.json"


@dataclass
class Generation:
    """A generation's root and indexes, as bytes: what a reader of them reads."""

    ref: GenerationRef
    files: dict[str, bytes]

    @property
    def root(self) -> dict[str, Any]:
        return json.loads(self.files[MANIFEST])


def snapshot(path: Path) -> Generation:
    step, generation_id = path.name.removeprefix("step-").split(".", 1)
    ref = GenerationRef(GenerationName(int(step), generation_id), str(path))
    names = [MANIFEST, *sorted(p.name for p in path.glob("*-index.json"))]
    return Generation(ref, {name: (path / name).read_bytes() for name in names})


def spread_over_two_ranks(path: Path) -> None:
    """Rewrite a one-rank generation's logical manifest as two ranks': every other
    tensor in rank 1's file (a copy of rank 0's), ``model/fc1.weight`` split in two
    row halves, one per rank, and ``model/fc2.weight`` as three boxes that are no
    grid. (Only the indexes are fuzzed here, not the tensor files.)"""
    document = read_logical(path)
    source = next(iter(document["files"]))
    other = "r00001" + source[len("r00000") :]
    shutil.copy(path / source, path / other)
    document["files"][other] = dict(document["files"][source])
    tensors = document["dcp"]["tensors"]
    for position, fqn in enumerate(sorted(tensors)):
        for chunk in tensors[fqn]["chunks"]:
            chunk["file"] = other if position % 2 else source
    (whole,) = tensors["model/fc1.weight"]["chunks"]
    half = whole["length"] // 2
    tensors["model/fc1.weight"]["chunks"] = [
        {**whole, "sizes": [8, 8], "length": half, "file": source},
        {
            **whole,
            "offsets": [8, 0],
            "sizes": [8, 8],
            "start": whole["start"] + half,
            "file": other,
        },
    ]
    (whole,) = tensors["model/fc2.weight"]["chunks"]  # [2, 16]
    boxes = [([0, 0], [1, 16], source), ([1, 0], [1, 8], other), ([1, 8], [1, 8], source)]
    tensors["model/fc2.weight"]["chunks"] = [
        {**whole, "offsets": o, "sizes": s, "file": f, "length": 4 * s[1]} for o, s, f in boxes
    ]
    write_logical(path, document)


@pytest.fixture(scope="module")
def generations(tmp_path_factory: pytest.TempPathFactory) -> list[Generation]:
    root = tmp_path_factory.mktemp("fuzz-indexes")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_STATE_HOME", str(root / "state"))
        with cv.CheckpointManager(root / "store", run_id="fuzz", chunk_size=1024) as mgr:
            path = Path(mgr.save(1, make_training_state()).result().path)
    two = root / "two" / path.name
    shutil.copytree(path, two)
    two.chmod(0o755)
    for file in two.iterdir():
        writable(file)
    spread_over_two_ranks(two)
    found = [snapshot(path), snapshot(two)]
    assert [len(g.files) for g in found] == [2, 3]
    for generation in found:  # the starting points load
        manifest = parse_manifest(generation.files[MANIFEST], "fixture")
        assert not load_indexes(Bytes(generation.files), generation.ref, manifest).pending_indexes
    return found


class Bytes:
    """The part of a store ``load_indexes`` uses: ``read_bytes`` of named files."""

    def __init__(self, files: dict[str, bytes]) -> None:
        self.files = files

    def read_bytes(self, _ref: GenerationRef, name: str, limit: int) -> bytes:
        return self.files[name][:limit]


# -- hostile index bytes ----------------------------------------------------------------


def index_cases(generation: Generation) -> list[tuple[bytes, dict[str, Any]]]:
    """Each index of ``generation`` with what its parser is told: the root's view."""
    manifest = parse_manifest(generation.files[MANIFEST], "fixture")
    assert manifest.tensor_table is not None
    shapes = {fqn: layout.shape for fqn, layout in manifest.tensor_table.tensors.items()}
    cases = []
    for name in sorted(manifest.indexes or {}):
        holder = file_holder(name)
        files = {n: r for n, r in manifest.files.items() if file_holder(n) == holder}
        context = {"holder": holder, "run_id": manifest.run_id, "files": files, "shapes": shapes}
        cases.append((generation.files[name], {**context, "generation_id": manifest.generation_id}))
    return cases


def check_index(data: bytes, context: dict[str, Any], trials) -> None:
    trials.count()
    outcome = measured(
        parse_index,
        data,
        context["holder"],
        context["run_id"],
        context["generation_id"],
        context["files"],
        context["shapes"],
        "fuzz",
    )
    assert outcome.peak <= 64 * len(data) + (4 << 20), f"{len(data)} bytes took {outcome.peak}"
    if outcome.error is not None:
        refused(trials, outcome.error)
        return
    contents = outcome.value
    trials.outcome("accepted")
    raw = json.loads(data)
    assert dumps_canonical(raw) == data  # canonical, and says exactly this:
    assert (raw["holder"], raw["run_id"], raw["generation_id"]) == (
        contents.holder,
        context["run_id"],
        context["generation_id"],
    )
    assert contents.file_chunks == {name: tuple(d) for name, d in raw["files"].items()}
    assert set(contents.file_chunks) == set(context["files"])
    keys = ("offsets", "sizes", "file", "name", "start", "length")
    assert contents.chunks == {
        fqn: [dict(zip(keys, entry, strict=True)) for entry in entries]
        for fqn, entries in raw["tensors"].items()
    }
    for fqn, chunks in contents.chunks.items():
        shape = context["shapes"][fqn]
        for chunk in chunks:  # inside the shape, in one of the index's own files
            assert chunk["file"] in context["files"]
            assert all(
                o + s <= d for o, s, d in zip(chunk["offsets"], chunk["sizes"], shape, strict=True)
            )


def test_index_parser_refuses_hostile_bytes_with_typed_errors(generations):
    cases = st.sampled_from([case for g in generations for case in index_cases(g)])
    inputs = cases.flatmap(
        lambda case: st.tuples(
            st.binary(max_size=256)
            | mutated_bytes(case[0])
            | mutated_json(json.loads(case[0])).map(
                lambda d: render(d).encode("utf-8", "surrogatepass")
            )
            | st.just(case[0]),
            st.just(case[1]),
        )
    )
    with scenario("fuzz: index parser, hostile bytes") as trials:

        @fuzz_settings(ci=300, long=10_000)
        @given(inputs)
        def hostile(case: tuple[bytes, dict[str, Any]]) -> None:
            check_index(*case, trials)

        hostile()


# -- load_indexes, behind rewritten digests ---------------------------------------------


def loaded_or_none(data: bytes) -> Any:
    """``data`` as JSON (as Python's parser reads it), or None when it reads none."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return None


def sealed(root: Any) -> bytes | None:
    """``root`` with its self-digest recomputed over what the rest renders to; None
    when it is no object or renders to nothing JSON can say (a float Python's parser
    read as infinite)."""
    if not isinstance(root, dict):
        return None
    body = {key: value for key, value in root.items() if key != SELF_DIGEST_KEY}
    try:
        digest = blake3(render(body).encode("utf-8", "surrogatepass")).hexdigest()
    except ValueError:
        return None
    return render({**body, SELF_DIGEST_KEY: digest}).encode("utf-8", "surrogatepass")


@st.composite
def edited_generations(draw: st.DrawFn, generation: Generation) -> dict[str, bytes]:
    """One edit of the root or an index (JSON-level, often a single change; or
    byte-level), and what an attacker writes after it: the root recording the edited
    index's size and digest, the root's self-digest recomputed (when the edit left
    a root to reseal). (One edit an example: a second would parse the first's output,
    whose nesting Python's parser meets at a depth that depends on the stack.)"""
    files = dict(generation.files)
    target = draw(st.sampled_from(sorted(files)))
    document = None
    if draw(st.integers(0, 3)):
        changes = draw(st.sampled_from([1, 3]))
        document = draw(mutated_json(json.loads(files[target]), max_ops=changes))
        files[target] = render(document).encode("utf-8", "surrogatepass")
    else:
        files[target] = draw(mutated_bytes(files[target]))
    if target == MANIFEST:
        root = document if document is not None else loaded_or_none(files[MANIFEST])
    else:
        root = json.loads(files[MANIFEST])
        root["indexes"][target] = {
            "size": len(files[target]),
            "blake3": blake3(files[target]).hexdigest(),
        }
    resealed = sealed(root)
    return files if resealed is None else {**files, MANIFEST: resealed}


def file_set_refusal(manifest: Any, files: dict[str, bytes]) -> str | None:
    """Rule 5 as check_structure applies it before any index is read: the indexes
    on disk are exactly the root's, with the sizes it records."""
    present = {name for name in files if name != MANIFEST}
    if present != set(manifest.indexes or {}):
        return "file set"
    if any(len(files[name]) != record.size for name, record in (manifest.indexes or {}).items()):
        return "size"
    return None


def check_loaded(manifest: Any) -> None:
    """A loaded generation: no index pending, every file's chunk digests, and each
    tensor's chunks exactly the cells its table gives each index (a listed layout
    tiling its shape)."""
    assert not manifest.pending_indexes
    for name, record in manifest.files.items():
        assert len(record.chunks) == -(-record.size // manifest.chunk_size), name
    for fqn, layout in manifest.tensor_table.tensors.items():
        loaded = sorted(
            (tuple(c["offsets"]), tuple(c["sizes"]), file_holder(c["file"]))
            for c in manifest.dcp["tensors"][fqn]["chunks"]
            if math.prod(c["sizes"])
        )
        assert loaded == sorted(expanded(layout.to_json())), fqn
        if layout.chunks is not None:
            boxes = [{"offsets": list(o), "sizes": list(s)} for o, s, _h in loaded]
            assert tiling_problem(list(layout.shape), boxes) is None


def parse_and_load(generation: Generation, files: dict[str, bytes]) -> tuple[str, Any]:
    manifest = parse_manifest(files[MANIFEST], "fuzz")
    if not manifest.indexed:
        return "an older format", manifest
    refusal = file_set_refusal(manifest, files)
    if refusal is not None:
        return refusal, manifest
    store = Bytes(files)
    whole = load_indexes(store, generation.ref, manifest)
    check_loaded(whole)
    one_by_one = manifest
    for name in sorted(manifest.indexes or {}, reverse=True):
        one_by_one = load_indexes(store, generation.ref, one_by_one, {name})
    assert one_by_one.files == whole.files
    assert {
        fqn: sorted(map(str, info["chunks"])) for fqn, info in one_by_one.dcp["tensors"].items()
    } == {fqn: sorted(map(str, info["chunks"])) for fqn, info in whole.dcp["tensors"].items()}
    return "loaded", whole


def test_index_loader_refuses_edits_behind_rewritten_digests(generations):
    with scenario("fuzz: index loader, edits behind rewritten digests") as trials:

        @fuzz_settings(ci=200, long=5_000)
        @given(st.sampled_from(range(len(generations))), st.data())
        def edited(which: int, data: st.DataObject) -> None:
            generation = generations[which]
            files = data.draw(edited_generations(generation), label="files")
            trials.count()
            outcome = measured(parse_and_load, generation, files)
            total = sum(len(data) for data in files.values())
            assert outcome.peak <= 64 * total + (4 << 20), f"{total} bytes took {outcome.peak}"
            if outcome.error is not None:
                refused(trials, outcome.error)
                return
            trials.outcome(outcome.value[0])

        edited()
