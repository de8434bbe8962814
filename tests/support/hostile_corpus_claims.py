"""Corpus entries (see :mod:`hostile_corpus`): enormous claims (sizes, lengths and
counts nobody should allocate for) and malformed JSON (depth, duplicated keys,
non-canonical forms), each in formats 3 and 2 (the manifest edited is format 3's
root and indexes or format 2's one manifest, through the logical document). Those
aimed at format 3's own structures are in :mod:`hostile_corpus_indexes`."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable

from ckptvault.format.canonical import dumps_canonical
from support.hostile_corpus import CLAIMS, JSON, hostile
from support.hostile_inputs import replace_header, tensor_file_parts
from support.hostile_plants import (
    Plot,
    deep,
    forge_manifest,
    replace_bytes,
    resign,
)
from support.reliability import budget

# -- enormous claims: counts, sizes and lengths nobody should allocate for ---------------


def _length_prefix(plot: Plot, length: int) -> int:
    file = plot.tensor_file(2)
    replace_bytes(file, struct.pack("<Q", length) + file.read_bytes()[8:])
    forge_manifest(plot.gen(2))
    return 2


@hostile(CLAIMS, "plain", "tensor-file-invalid", formats=(3, 2))
def tensor_header_claims_2_to_the_63_bytes(plot: Plot) -> int:
    return _length_prefix(plot, 2**63)


@hostile(CLAIMS, "plain", "tensor-file-invalid", formats=(3, 2))
def tensor_header_claims_2_to_the_64_minus_1_bytes(plot: Plot) -> int:
    return _length_prefix(plot, 2**64 - 1)


def _edit_header_entry(plot: Plot, key: str, value: object) -> int:
    file = plot.tensor_file(2)
    header = json.loads(tensor_file_parts(file)[0])
    name = next(n for n in sorted(header) if n != "__metadata__")
    header[name][key] = value
    replace_header(file, json.dumps(header, separators=(",", ":")).encode())
    forge_manifest(plot.gen(2))
    return 2


@hostile(CLAIMS, "plain", "tensor-file-invalid", formats=(3, 2))
def tensor_entry_claims_2_to_the_62_bytes(plot: Plot) -> int:
    return _edit_header_entry(plot, "data_offsets", [0, 2**62])


@hostile(CLAIMS, "plain", "tensor-file-invalid", formats=(3, 2))
def tensor_entry_claims_a_trillion_elements(plot: Plot) -> int:
    return _edit_header_entry(plot, "shape", [10**12, 10**12])


@hostile(CLAIMS, "encrypted", "tensor-file-invalid", formats=(3, 2))
def container_header_claims_4_gib(plot: Plot) -> int:
    file = plot.tensor_file(2)
    data = file.read_bytes()
    replace_bytes(file, data[:8] + struct.pack("<I", 2**32 - 1) + data[12:])
    forge_manifest(plot.gen(2))
    return 2


@hostile(CLAIMS, "encrypted", "tensor-file-invalid", formats=(3, 2))
def container_claims_an_exabyte_of_plaintext(plot: Plot) -> int:
    file = plot.tensor_file(2)
    data = file.read_bytes()
    (length,) = struct.unpack("<I", data[8:12])
    header = json.loads(data[12 : 12 + length])
    header["plaintext_size"] = 2**60
    body = dumps_canonical(header)
    replace_bytes(file, data[:8] + struct.pack("<I", len(body)) + body + data[12 + length :])
    forge_manifest(plot.gen(2))
    return 2


def _file_record(plot: Plot, **fields: object) -> None:
    name = plot.tensor_file(2).name
    forge_manifest(plot.gen(2), lambda m: m["files"][name].update(fields))


@hostile(CLAIMS, "plain", "size-mismatch", formats=(3, 2))
def manifest_claims_a_terabyte_file(plot: Plot) -> int:
    """A consistent claim (one digest per GiB chunk): only the listing contradicts it."""
    name = plot.tensor_file(2).name

    def claim(manifest: dict) -> None:
        manifest["chunk_size"] = 2**30
        record = manifest["files"][name]
        record.update(size=10**12, chunks=record["chunks"] * -(-(10**12) // 2**30))

    forge_manifest(plot.gen(2))
    forge_manifest(plot.gen(2), claim)
    return 2


@hostile(CLAIMS, "plain", "manifest-invalid", formats=(3, 2))
def manifest_claims_a_2_to_the_63_byte_file(plot: Plot) -> int:
    _file_record(plot, size=2**63)
    return 2


@hostile(CLAIMS, "plain", "manifest-invalid", formats=(3, 2))
def manifest_claims_a_negative_size(plot: Plot) -> int:
    _file_record(plot, size=-1)
    return 2


@hostile(CLAIMS, "plain", "manifest-invalid", formats=(3, 2))
def manifest_claims_a_1e308_size(plot: Plot) -> int:
    _file_record(plot, size=1e308)
    return 2


@hostile(CLAIMS, "plain", "manifest-invalid", formats=(3, 2))
def manifest_claims_a_nan_size(plot: Plot) -> int:
    name = plot.tensor_file(2).name
    forge_manifest(plot.gen(2), lambda m: m["files"][name].update(size="@n@"), {"@n@": "NaN"})
    return 2


@hostile(CLAIMS, "plain", "manifest-invalid", formats=(3, 2))
def manifest_claims_an_infinite_size(plot: Plot) -> int:
    name = plot.tensor_file(2).name
    forge_manifest(plot.gen(2), lambda m: m["files"][name].update(size="@i@"), {"@i@": "Infinity"})
    return 2


@hostile(CLAIMS, "plain", "manifest-invalid", formats=(3, 2))
def manifest_claims_an_exabyte_chunk_size(plot: Plot) -> int:
    forge_manifest(plot.gen(2), lambda m: m.update(chunk_size=2**62))
    return 2


@hostile(CLAIMS, "plain", "manifest-invalid", formats=(3, 2))
def manifest_claims_a_trillion_element_tensor(plot: Plot) -> int:
    def claim(manifest: dict) -> None:
        info = manifest["dcp"]["tensors"]["model/fc1.weight"]
        info["shape"] = info["chunks"][0]["sizes"] = [10**12, 10**12]

    forge_manifest(plot.gen(2), claim)
    return 2


# Only restore and export decode the saved state: verify checks structure and bytes.
DECODING = frozenset({"verify", "cli verify", "cli inspect"})


@hostile(CLAIMS, "plain", "manifest-invalid", blind=DECODING, formats=(3, 2))
def manifest_claims_a_trillion_ranks(plot: Plot) -> int:
    forge_manifest(plot.gen(2), lambda m: m["writer"].update(world_size=10**12))
    return 2


@hostile(CLAIMS, "plain", "manifest-invalid", formats=(3, 2))
def manifest_claims_a_step_beyond_int64(plot: Plot) -> int:
    forge_manifest(plot.gen(2), lambda m: m.update(step=2**63))
    return 2


# Counts a manifest can really hold (it is capped at 64 MiB): memory follows the bytes
# written, never the counts claimed.
MANY = budget(500, 50_000)


@hostile(CLAIMS, "plain", "file-missing", formats=(3, 2))
def manifest_lists_thousands_of_missing_files(plot: Plot) -> int:
    """(In format 3, rank 0's: its index lists their chunk digests.)"""
    record = {"size": 0, "blake3": "0" * 64, "chunks": []}
    prefix = "r00000-" if plot.format == 3 else ""
    many = {f"{prefix}f{i:06d}.safetensors": record for i in range(MANY)}
    forge_manifest(plot.gen(2), lambda m: m["files"].update(many))
    return 2


@hostile(CLAIMS, "plain", "manifest-inconsistent", formats=(3, 2))
def manifest_claims_the_same_bytes_thousands_of_times(plot: Plot) -> int:
    def claim(manifest: dict) -> None:
        info = manifest["dcp"]["tensors"]["model/fc1.weight"]
        info["chunks"] = info["chunks"] * MANY

    forge_manifest(plot.gen(2), claim)
    return 2


# -- malformed JSON: depth, duplicates, non-canonical forms ------------------------------


@hostile(JSON, "plain", "manifest-invalid", formats=(3, 2))
def deeply_nested_manifest(plot: Plot) -> int:
    forge_manifest(plot.gen(2), lambda m: m.update(contract="@d@"), {"@d@": deep(20_000)})
    return 2


@hostile(JSON, "plain", "tensor-file-invalid", formats=(3, 2))
def deeply_nested_tensor_header(plot: Plot) -> int:
    replace_header(plot.tensor_file(2), deep(20_000).encode())
    forge_manifest(plot.gen(2))
    return 2


@hostile(JSON, "encrypted", "tensor-file-invalid", formats=(3, 2))
def deeply_nested_container_header(plot: Plot) -> int:
    file = plot.tensor_file(2)
    data = file.read_bytes()
    (length,) = struct.unpack("<I", data[8:12])
    body = deep(20_000).encode()
    replace_bytes(file, data[:8] + struct.pack("<I", len(body)) + body + data[12 + length :])
    forge_manifest(plot.gen(2))
    return 2


@hostile(JSON, "signed", "signature-invalid")
def deeply_nested_signature(plot: Plot) -> int:
    replace_bytes(plot.gen(2) / "manifest.sig", deep(20_000).encode())
    return 2


# The top-level keys, as canonical JSON spells them (followed by the next key: a
# format-3 root has its tensor table after the step, format 2 the writer).
RUN = b'"run_id":"r","state"'


def _step(plot: Plot) -> bytes:
    return b'"step":2,"tensors"' if plot.format == 3 else b'"step":2,"writer"'


def _manifest_text(plot: Plot, edit: Callable[[bytes], bytes]) -> None:
    """Rewrite the (correctly self-digested) manifest's bytes with ``edit``."""
    path = plot.gen(2) / "manifest.json"
    data = path.read_bytes()
    edited = edit(data)
    assert edited != data, "the edit did not apply"
    replace_bytes(path, edited)


@hostile(JSON, "plain", "manifest-invalid", formats=(3, 2))
def duplicated_key_in_the_manifest(plot: Plot) -> int:
    step = _step(plot)
    _manifest_text(plot, lambda data: data.replace(step, b'"step":1,' + step))
    return 2


@hostile(JSON, "signed", "manifest-invalid", formats=(3, 2))
def duplicated_key_in_a_validly_signed_manifest(plot: Plot) -> int:
    _manifest_text(plot, lambda data: data.replace(RUN, b'"run_id":"x",' + RUN))
    resign(plot.gen(2), plot.key("trainer.pem"))  # an insider: still not canonical
    return 2


@hostile(JSON, "plain", "tensor-file-invalid", formats=(3, 2))
def duplicated_key_in_a_tensor_header(plot: Plot) -> int:
    """The first tensor named twice, the last one right; the manifest's chunk starts
    follow the longer header, so only the duplicate is wrong. (Accepted, last one
    winning, until loads_bounded refused duplicate keys.)"""
    file = plot.tensor_file(2)
    header, body = tensor_file_parts(file)
    text = header.decode().rstrip()
    name = next(n for n in sorted(json.loads(text)) if n != "__metadata__")
    decoy = {name: {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}
    doubled = ("{" + json.dumps(decoy, separators=(",", ":"))[1:-1] + "," + text[1:]).encode()
    doubled += b" " * (-len(doubled) % 8)
    replace_bytes(file, struct.pack("<Q", len(doubled)) + doubled + body)

    def follow(manifest: dict) -> None:
        for info in manifest["dcp"]["tensors"].values():
            for chunk in info["chunks"]:
                chunk["start"] += len(doubled) - len(header)

    forge_manifest(plot.gen(2), follow)
    return 2


@hostile(JSON, "plain", "manifest-invalid", formats=(3, 2))
def pretty_printed_manifest(plot: Plot) -> int:
    _manifest_text(plot, lambda data: json.dumps(json.loads(data), indent=1).encode())
    return 2


@hostile(JSON, "plain", "manifest-invalid", formats=(3, 2))
def manifest_keys_out_of_order(plot: Plot) -> int:
    def reorder(data: bytes) -> bytes:
        document = json.loads(data)
        flipped = dict(reversed(list(document.items())))
        return json.dumps(flipped, separators=(",", ":"), ensure_ascii=False).encode()

    _manifest_text(plot, reorder)
    return 2


@hostile(JSON, "plain", "manifest-invalid", formats=(3, 2))
def escaped_key_in_the_manifest(plot: Plot) -> int:
    step = _step(plot)
    _manifest_text(plot, lambda data: data.replace(step, b'"\\u0073tep"' + step[6:]))
    return 2


@hostile(JSON, "plain", "manifest-invalid", formats=(3, 2))
def float_spelling_of_the_step(plot: Plot) -> int:
    step = _step(plot)
    _manifest_text(plot, lambda data: data.replace(step, step.replace(b":2,", b":2e0,")))
    return 2


@hostile(JSON, "plain", "manifest-invalid", formats=(3, 2))
def byte_order_mark_and_newline(plot: Plot) -> int:
    _manifest_text(plot, lambda data: b"\xef\xbb\xbf" + data + b"\n")
    return 2


@hostile(JSON, "plain", "manifest-invalid", formats=(3, 2))
def invalid_utf8_in_the_manifest(plot: Plot) -> int:
    _manifest_text(plot, lambda data: data.replace(RUN, b'"run_id":"r\xff","state"'))
    return 2


@hostile(JSON, "plain", "manifest-invalid", formats=(3, 2))
def lone_surrogate_in_the_manifest(plot: Plot) -> int:
    forge_manifest(plot.gen(2), lambda m: m.update(run_id="@s@"), {"@s@": '"\\ud800"'})
    return 2


@hostile(JSON, "plain", "manifest-invalid", formats=(3, 2))
def nan_metric_in_the_manifest(plot: Plot) -> int:
    forge_manifest(plot.gen(2), lambda m: m.update(metrics={"loss": "@n@"}), {"@n@": "NaN"})
    return 2


@hostile(JSON, "signed", "manifest-invalid", formats=(3, 2))
def pretty_printed_validly_signed_manifest(plot: Plot) -> int:
    _manifest_text(plot, lambda data: json.dumps(json.loads(data), indent=1).encode())
    resign(plot.gen(2), plot.key("trainer.pem"))  # an insider: the bytes must be canonical
    return 2
