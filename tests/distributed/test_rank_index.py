"""Rank 0's checks of what other ranks announce in a collective save, in one process:
an index a rank wrote (its bytes against its announced size and digest, its identity,
its chunk list against the plan, its chunk digests against the files' digests), the
short write results of a reused plan, and the announcement of a plan's digest.
Everything another rank could get wrong, or lie about, is refused with a typed error
naming the rank; the index a rank writes honestly passes and restores as today's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from blake3 import blake3

from ckptvault.distributed.plan_wire import announcement
from ckptvault.distributed.rank_index import (
    SaveIndexes,
    check_rank_index,
    expectation,
    root_indexes,
    write_rank_index,
)
from ckptvault.distributed.result_wire import index_record, short_results_from_json
from ckptvault.errors import FormatError, IntegrityError, PeerMessageError
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.index import IndexRecord, parse_index
from ckptvault.format.layout import new_generation_id
from ckptvault.format.records import FileRecord
from ckptvault.storage.posix.store import PosixStore
from ckptvault.trust.digests import derived_file_digest

CHUNK = 4
GENERATION = new_generation_id()


def record(size: int, seed: int) -> FileRecord:
    chunks = tuple(blake3(bytes([seed, i])).hexdigest() for i in range(-(-size // CHUNK)))
    return FileRecord(size, derived_file_digest(size, chunks), chunks)


RECORDS = {"r00003-000.safetensors": record(10, 1), "r00003-001.safetensors": record(4, 2)}
CHUNKS = {
    "w": [
        {
            "offsets": [2, 0],
            "sizes": [1, 2],
            "file": "r00003-000.safetensors",
            "name": "w@2,0",
            "start": 2,
            "length": 8,
        },
    ],
    "b": [
        {
            "offsets": [0],
            "sizes": [1],
            "file": "r00003-001.safetensors",
            "name": "b",
            "start": 0,
            "length": 4,
        },
    ],
}
EXPECTED = expectation(3, {name: r.size for name, r in RECORDS.items()}, CHUNKS)


@pytest.fixture
def area(tmp_path: Path):
    store = PosixStore(tmp_path / "store")
    store.acquire_writer()
    staging = store.begin_generation(GENERATION)
    yield staging
    staging.abort()
    store.release_writer()


def written(area, records=RECORDS, chunks=CHUNKS) -> tuple[bytes, IndexRecord]:
    name, announced = write_rank_index(area, "run", GENERATION, 3, records, chunks)
    return area.read_staged(name, 1 << 20), announced


def check(data: bytes, announced: IndexRecord, files=RECORDS) -> None:
    check_rank_index(data, announced, EXPECTED, files, "run", GENERATION, CHUNK)


def test_an_honest_index_passes_and_parses_as_the_restore_parses_it(area):
    data, announced = written(area)
    check(data, announced)
    shapes = {"w": (3, 2), "b": (1,)}
    parsed = parse_index(data, 3, "run", GENERATION, RECORDS, shapes, "test")
    assert parsed.file_chunks == {name: r.chunks for name, r in RECORDS.items()}
    assert {fqn: [c["start"] for c in cs] for fqn, cs in parsed.chunks.items()} == {
        "w": [2],
        "b": [0],
    }


def reencoded(data: bytes, change) -> tuple[bytes, IndexRecord]:
    """The index with ``change`` made to its document, announced honestly."""
    document = json.loads(data)
    change(document)
    changed = dumps_canonical(document)
    return changed, IndexRecord(len(changed), blake3(changed).hexdigest())


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        (lambda d: d.__setitem__("holder", 4), FormatError, "identity"),
        (lambda d: d.__setitem__("generation_id", new_generation_id()), FormatError, "identity"),
        (lambda d: d.__setitem__("run_id", "other"), FormatError, "identity"),
        (lambda d: d["tensors"]["w"][0].__setitem__(4, 3), FormatError, "chunks rank 0 planned"),
        (lambda d: d["tensors"].pop("b"), FormatError, "chunks rank 0 planned"),
        (lambda d: d["files"].pop("r00003-001.safetensors"), FormatError, "exactly the files"),
        (lambda d: d["files"]["r00003-000.safetensors"].pop(), FormatError, "chunk digests"),
        (
            lambda d: d["files"]["r00003-000.safetensors"].__setitem__(0, "0" * 64),
            IntegrityError,
            "do not derive",
        ),
        (
            lambda d: d["files"]["r00003-000.safetensors"].__setitem__(0, "G" * 64),
            IntegrityError,
            "do not derive",
        ),
    ],
)
def test_an_index_that_is_not_what_the_rank_must_hold_is_refused(area, change, error, words):
    changed, announced = reencoded(written(area)[0], change)
    with pytest.raises(error, match=words) as raised:
        check(changed, announced)
    assert "rank 3's index r00003-index.json" in str(raised.value)


def test_an_index_that_is_not_what_the_rank_announced_is_refused(area):
    data, announced = written(area)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    for bytes_, record_ in (
        (bytes(flipped), announced),
        (data + b" ", announced),
        (data, IndexRecord(announced.size, "0" * 64)),
    ):
        with pytest.raises(IntegrityError, match="not what the rank announced"):
            check(bytes_, record_)
    other = {**RECORDS, "r00003-001.safetensors": record(4, 9)}  # reported another digest
    with pytest.raises(IntegrityError, match="do not derive"):
        check(data, announced, other)


def test_rank_0_reads_back_no_more_than_a_rank_announced(area):
    data, announced = written(area)
    indexes = SaveIndexes("run", GENERATION, announced={3: IndexRecord(len(data) - 1, "0" * 64)})
    indexes.expectations = {3: EXPECTED}
    with pytest.raises(OSError, match="larger than"):
        root_indexes(area, indexes, {}, RECORDS, CHUNK)
    indexes.announced = {3: announced}
    assert root_indexes(area, indexes, {}, RECORDS, CHUNK) == {"r00003-index.json": announced}


F0, F1 = "r00001-000.safetensors", "r00001-001.safetensors"
A = "a" * 64


@pytest.mark.parametrize(
    "message",
    [
        {"files": {F0: [16]}, "keys": {}},
        {"files": {F0: [17, A]}, "keys": {}},  # another size
        {"files": {F0: [True, A]}, "keys": {}},
        {"files": {F0: [16, "A" * 64]}, "keys": {}},
        {"files": {}, "keys": {}},  # a file missing
        {"files": {F0: [16, A], F1: [1, A]}, "keys": {}},  # a file more
        {"files": {F0: [16, A]}, "keys": {F0: ["k", "AA=="]}},  # a key in a plain run
        {"files": {F0: [16, A]}},
    ],
)
def test_short_results_name_exactly_the_planned_files_with_their_sizes(message):
    with pytest.raises(PeerMessageError, match="rank 1 sent write results"):
        short_results_from_json(message, 1, {F0: 16}, encrypted=False)
    good = {"files": {F0: [16, A]}, "keys": {}}
    records, keys = short_results_from_json(good, 1, {F0: 16}, False)
    assert records[F0].size == 16 and keys == {}


def test_an_index_record_comes_exactly_from_a_rank_that_wrote_an_index():
    good = {"size": 10, "blake3": "a" * 64}
    assert index_record(good, 2, writes_files=True) == IndexRecord(10, "a" * 64)
    assert index_record(None, 2, writes_files=False) is None
    assert index_record(None, 0, writes_files=True) is None  # rank 0 writes its own later
    for raw, rank, files in (
        (None, 2, True),  # a rank with files announces none
        (good, 0, True),
        (good, 2, False),
        ({"size": 0, "blake3": "a" * 64}, 2, True),
        ({"size": 10, "blake3": "a" * 64, "x": 1}, 2, True),
    ):
        with pytest.raises(PeerMessageError):
            index_record(raw, rank, writes_files=files)


@pytest.mark.parametrize(
    "raw",
    [
        {"digest": "a" * 64, "held": True},
        {"digest": "a" * 63, "held": True, "plan": None},
        {"digest": "a" * 64, "held": 1, "plan": None},
        {"digest": "a" * 64, "held": True, "plan": {"items": []}},  # a plan while it holds one
        {"digest": "a" * 64, "held": False, "plan": None},  # no plan while it holds none
    ],
)
def test_a_malformed_announcement_is_refused(raw):
    with pytest.raises(PeerMessageError, match="rank 5 sent its plan"):
        announcement(raw, 5)
    assert announcement({"digest": "a" * 64, "held": True, "plan": None}, 5)[1] is True
