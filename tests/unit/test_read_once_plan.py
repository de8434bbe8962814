"""Who reads which shared block in a multi-rank restore, and what a rank may claim.

The schedule every rank computes from the others' messages (``read_once``): one owner
per block two or more ranks need, the reading spread over them, nothing scheduled
for a block one rank alone needs; a rank's message naming files or blocks the
manifest does not hold is refused (``PeerMessageError``) before it is used.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from ckptvault.distributed.read_once import (
    _container,
    decode_needs,
    encode_needs,
    needed_blocks,
    schedule,
)
from ckptvault.errors import PeerMessageError
from ckptvault.format.container import SEGMENT_OVERHEAD, build_container_header

CHUNK = 100


def manifest(sizes: dict[str, int], encryption: Any = None) -> Any:
    files = {name: SimpleNamespace(size=size) for name, size in sizes.items()}
    return SimpleNamespace(files=files, chunk_size=CHUNK, encryption=encryption)


def test_ddp_every_block_is_read_by_one_rank_and_the_reading_is_spread():
    needs = [{"f": [(0, 9)]} for _ in range(4)]
    transfers = schedule(needs, {"f": 1000}, CHUNK)
    assert [t.index for t in transfers] == list(range(10))
    for t in transfers:
        assert t.receivers == tuple(r for r in range(4) if r != t.owner)
    owned = [sum(t.owner == r for t in transfers) for r in range(4)]
    assert max(owned) - min(owned) <= 1 and sum(owned) == 10
    # Each owner reads one contiguous run (sequential reads).
    owners = [t.owner for t in transfers]
    assert len({o for i, o in enumerate(owners) if i == 0 or owners[i - 1] != o}) == 4
    assert schedule(needs, {"f": 1000}, CHUNK) == transfers  # the same on every rank


def test_hsdp_shards_go_between_their_replicas_only_and_lone_blocks_are_not_sent():
    needs = [
        {"f": [(0, 3)], "g": [(0, 0)]},  # rank 0 alone needs g
        {"f": [(4, 7)]},
        {"f": [(0, 3)]},
        {"f": [(4, 7)]},
    ]
    transfers = schedule(needs, {"f": 800, "g": 50}, CHUNK)
    assert {t.name for t in transfers} == {"f"}
    for t in transfers:
        group = {0, 2} if t.index < 4 else {1, 3}
        assert {t.owner, *t.receivers} == group
    assert {t.owner for t in transfers} == {0, 1, 2, 3}  # both replicas of each read


def test_the_last_block_of_a_file_is_sent_at_its_own_length():
    [*_, last] = schedule([{"f": [(0, 2)]}] * 2, {"f": 250}, CHUNK)
    assert (last.index, last.length) == (2, 50)


@pytest.mark.parametrize(
    "raw",
    [
        {"other": [[0, 0]]},  # a file the manifest does not list
        {"f": [[0, 10]]},  # a block past the end of the file
        {"f": [[3, 5], [4, 6]]},  # overlapping runs: more blocks than the file holds
        {"f": [[5, 3]]},
        {"f": [[0, True]]},
        {"f": [[0.0, 1]]},
        {"f": [[-1, 1]]},
        {"f": [0, 1]},
        ["f"],
    ],
)
def test_a_message_naming_blocks_the_manifest_does_not_hold_is_refused(raw):
    with pytest.raises(PeerMessageError, match="rank 3 sent the blocks it reads"):
        decode_needs(raw, 3, manifest({"f": 1000}))


def test_needs_round_trip_and_a_rank_that_reads_alone_says_so():
    needs = {"f": [(0, 2), (5, 9)]}
    assert decode_needs(encode_needs(needs), 1, manifest({"f": 1000})) == needs
    assert decode_needs(encode_needs(None), 1, manifest({"f": 1000})) is None


def test_ranges_are_rounded_out_to_the_blocks_that_hold_them():
    found = needed_blocks([("f", 150, 420), ("f", 900, 1000), ("g", 0, 0)], manifest({"f": 1000}))
    assert found == {"f": [(1, 4), (9, 9)]}


@pytest.mark.parametrize("plaintext", [0, 1, 999, 1000, 12345, 10**9 + 7])
def test_an_encrypted_files_layout_is_found_from_its_size(plaintext):
    header = build_container_header(1000, plaintext)
    assert _container(header.stored_size, 1000) == header


def test_an_encrypted_range_needs_its_header_and_the_segments_holding_it():
    header = build_container_header(300, 3000)  # 10 segments of 300 plaintext bytes
    encryption = SimpleNamespace(segment_size=300, wrapped_keys={"f.enc": b""})
    stored = manifest({"f.enc": header.stored_size}, encryption)
    found = needed_blocks([("f.enc", 1000, 1100)], stored)
    sealed, first = 300 + SEGMENT_OVERHEAD, len(header.header_bytes)
    # The container header and segment 0 (the tensor header), then segment 3, which
    # holds plaintext bytes 900..1200.
    spans = [(0, first + sealed), (first + 3 * sealed, first + 4 * sealed)]
    wanted = {i for lo, hi in spans for i in range(lo // CHUNK, (hi - 1) // CHUNK + 1)}
    assert {i for lo, hi in found["f.enc"] for i in range(lo, hi + 1)} == wanted
