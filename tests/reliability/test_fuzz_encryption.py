"""Fuzzing segment encryption (``ckptvault.trust.envelope``): the encrypted container
every file of an encrypted run is stored in, written by ``EncryptingWriter`` and read
back by ``SegmentDecryptor``, which restore, export and the state file use.

- Round trip: random plaintexts, segment sizes, keys and bindings (run id,
  generation id, file name), written and fed in random pieces, decrypt to the same
  bytes at the right offsets.
- Tampering: any edit of the segments (nonce, ciphertext, tag; bits flipped, bytes
  inserted or deleted, truncated, extended; segments swapped, dropped, repeated),
  any other key, or any other binding is refused with a ckptvault error (AES-GCM's
  ``InvalidTag`` surfaces as ``DecryptionError``). The header is not under the tags
  (the file's digest in the manifest covers it): an edit of the header alone is
  refused, or leaves the segmentation as it was (an unknown key; a segment size no
  segment reaches) and yields the same plaintext. Whatever plaintext came out before
  a refusal is the true plaintext: a decryptor never hands out a forged byte. Memory
  stays within what was fed and one segment's buffer.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptvault.errors import CheckpointError
from ckptvault.format.container import (
    SEGMENT_OVERHEAD,
    container_header_length,
    parse_container_header,
)
from ckptvault.trust.envelope import EncryptingWriter, SegmentDecryptor, binding
from support.fuzzing import (
    fuzz_settings,
    measured,
    mutated_bytes,
    mutated_json,
    refused,
    render,
    scenario,
)

pytestmark = [pytest.mark.fuzz, pytest.mark.reliability]

keys = st.binary(min_size=32, max_size=32)
names = st.text(max_size=12)


class Sink:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, data: Any) -> int:
        self.data += data
        return len(memoryview(data))


@st.composite
def pieces(draw: st.DrawFn, data: bytes) -> list[bytes]:
    """``data`` cut at random places (empty pieces included)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=6)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@st.composite
def sealed(draw: st.DrawFn) -> dict[str, Any]:
    """A plaintext encrypted as a container, with everything needed to open it."""
    plaintext = draw(st.binary(max_size=1500))
    case = {
        "plaintext": plaintext,
        "key": draw(keys),
        "binding": (draw(names), draw(names), draw(names)),
        "segment_size": draw(st.integers(1, 16) | st.integers(1, 2048)),
    }
    sink = Sink()
    writer = EncryptingWriter(
        sink, case["key"], binding(*case["binding"]), case["segment_size"], len(plaintext)
    )
    for piece in draw(pieces(plaintext)):
        writer.write(piece)
    writer.close()
    case["container"] = bytes(sink.data)
    case["header_size"] = len(writer.header.header_bytes)
    return case


def decrypt(container: bytes, key: bytes, context: bytes, feeds: list[bytes]) -> dict[int, bytes]:
    """Feed ``container`` in ``feeds`` (which concatenate to it), then finish; what
    came out, by plaintext offset."""
    emitted: dict[int, bytes] = {}

    def emit(offset: int, data: memoryview) -> None:
        assert offset not in emitted
        emitted[offset] = bytes(data)

    decryptor = SegmentDecryptor(key, context, "fuzz", emit)
    for piece in feeds:
        decryptor.feed(piece)
    decryptor.finish()
    return emitted


def joined(emitted: dict[int, bytes]) -> bytes:
    out = b""
    for offset in sorted(emitted):
        assert offset == len(out), "plaintext offsets must be contiguous"
        out += emitted[offset]
    return out


def test_segment_encryption_round_trip():
    with scenario("fuzz: segment encryption round trip") as trials:

        @fuzz_settings(ci=200, long=5_000)
        @given(sealed(), st.data())
        def round_trip(case: dict[str, Any], data: st.DataObject) -> None:
            trials.count()
            container = case["container"]
            header = parse_container_header(container, len(container), "fuzz")
            assert header.plaintext_size == len(case["plaintext"])
            assert header.stored_size == len(container)
            feeds = data.draw(pieces(container))
            emitted = decrypt(container, case["key"], binding(*case["binding"]), feeds)
            assert joined(emitted) == case["plaintext"]
            many = header.segments
            trials.outcome(
                "1 segment" if many == 1 else "2-9 segments" if many < 10 else "10+ segments"
            )

        round_trip()


# -- tampering --------------------------------------------------------------------------


def _records(case: dict[str, Any]) -> list[bytes]:
    """The container's segment records (nonce, ciphertext, tag), in order."""
    body = case["container"][case["header_size"] :]
    size, plain = case["segment_size"], len(case["plaintext"])
    records, position = [], 0
    while position < len(body):
        length = min(size, plain) + SEGMENT_OVERHEAD
        records.append(body[position : position + length])
        position += length
        plain -= size
    return records


@st.composite
def tampered(draw: st.DrawFn, case: dict[str, Any]) -> tuple[bytes, bytes, bytes, str]:
    """``(container, key, context, what was done)``: one kind of tampering."""
    container, key = case["container"], case["key"]
    run, generation, name = case["binding"]
    context = binding(run, generation, name)
    head, records = container[: case["header_size"]], _records(case)
    kind = draw(
        st.sampled_from(
            ["bytes", "bytes", "header", "key", "binding", "reorder", "drop", "repeat", "cut"]
        )
    )
    if kind == "bytes":
        container = draw(mutated_bytes(container))
    elif kind == "header":
        body = json.loads(head[12:])
        text = render(draw(mutated_json(body))).encode("utf-8", "surrogatepass")
        container = head[:8] + len(text).to_bytes(4, "little") + text + b"".join(records)
    elif kind == "key":
        key = draw(keys.filter(lambda other: other != case["key"]))
    elif kind == "binding":
        which = draw(st.integers(0, 2))
        fields = [run, generation, name]
        fields[which] = draw(names.filter(lambda other: other != fields[which]))
        context = binding(*fields)
    elif kind == "reorder" and len(records) > 1:
        i, j = draw(st.lists(st.integers(0, len(records) - 1), min_size=2, max_size=2, unique=True))
        records[i], records[j] = records[j], records[i]
        container = head + b"".join(records)
    elif kind == "drop":
        del records[draw(st.integers(0, len(records) - 1))]
        container = head + b"".join(records)
    elif kind == "repeat":
        at = draw(st.integers(0, len(records) - 1))
        records.insert(draw(st.integers(0, len(records))), records[at])
        container = head + b"".join(records)
    else:  # cut at a segment boundary, or at any byte
        boundaries = [len(head) + sum(map(len, records[:i])) for i in range(len(records))]
        container = container[: draw(st.sampled_from(boundaries) | st.integers(0, len(container)))]
    return container, key, context, kind


def _segments(container: bytes) -> bytes | None:
    """Everything after a container's header (None when its prefix is no header)."""
    try:
        return container[container_header_length(container[:12], "fuzz") :]
    except CheckpointError:
        return None


def _declared(container: bytes) -> int:
    """The plaintext buffer a container's header makes a decryptor allocate."""
    try:
        header = parse_container_header(container, None, "fuzz")
    except CheckpointError:
        return 0
    return min(header.segment_size, header.plaintext_size)


def test_segment_decryption_refuses_tampering():
    with scenario("fuzz: segment decryption, tampering") as trials:

        @fuzz_settings(ci=200, long=10_000)
        @given(sealed().flatmap(lambda case: st.tuples(st.just(case), tampered(case))), st.data())
        def tamper(example: tuple[dict[str, Any], tuple[bytes, bytes, bytes, str]], data):
            trials.count()
            case, (container, key, context, kind) = example
            original = case["container"]
            unchanged = (
                key == case["key"]
                and context == binding(*case["binding"])
                and _segments(container) == original[case["header_size"] :]
            )
            emitted: dict[int, bytes] = {}

            def emit(offset: int, piece: memoryview) -> None:
                emitted[offset] = bytes(piece)

            def run() -> None:
                decryptor = SegmentDecryptor(key, context, "fuzz", emit)
                for piece in data.draw(pieces(container)):
                    decryptor.feed(piece)
                decryptor.finish()

            outcome = measured(run)
            # The decryptor holds what it was fed and one segment's plaintext buffer,
            # as large as the header declares (at most MAX_SEGMENT_SIZE, 64 MiB).
            assert outcome.peak <= 4 * len(container) + _declared(container) + (1 << 20)
            # Never a forged byte: what came out is the true plaintext at its offset.
            for offset, piece in emitted.items():
                assert piece == case["plaintext"][offset : offset + len(piece)], kind
            if outcome.error is None:
                assert unchanged, f"{kind}: tampering with the segments went unnoticed"
                assert joined(emitted) == case["plaintext"]
                trials.outcome("unchanged, decrypted")
                return
            refused(trials, outcome.error)

        tamper()
