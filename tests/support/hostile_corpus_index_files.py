"""Corpus entries (see :mod:`hostile_corpus`) aimed at format 3's index files as
files: signed and encrypted roots over edited indexes, names and links that lead
out of the generation, pickle payloads and malformed JSON where an index belongs,
and enormous claims in the root's records and tensor table. What an index and the
table say is in :mod:`hostile_corpus_indexes`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ckptvault.format.index import MAX_INDEX_BYTES, MAX_INDEX_DEPTH
from ckptvault.format.manifest import MAX_ROOT_BYTES
from ckptvault.format.tensor_table import MAX_CELLS
from support.forging import read_logical
from support.hostile_corpus import CLAIMS, JSON, PATHS, PICKLE, TRUST, hostile
from support.hostile_corpus_indexes import FQN, INDEX, box, edit_chunks, edit_index, edit_table
from support.hostile_forging import reseal, write_index
from support.hostile_plants import (
    Plot,
    copy_generation,
    deep,
    forge_root,
    pickle_payload,
    resign,
    torch_save_payload,
)

# -- trust: signed and encrypted roots over edited indexes ------------------------------


@hostile(TRUST, "signed", "signature-invalid")
def index_edited_and_recorded_under_a_signed_root(plot: Plot) -> int:
    return edit_chunks(plot, box([8, 0], [8, 8]))


@hostile(TRUST, "signed", "manifest-invalid")
def another_runs_index_under_a_validly_signed_root(plot: Plot) -> int:
    """An insider records run "other"'s index in the root and signs it: the index
    names its own run and generation, so the signature does not make it this one's."""
    (other,) = sorted((plot.root / "other").glob("step-*"))
    write_index(plot.gen(2), INDEX, (other / INDEX).read_bytes())
    resign(plot.gen(2), plot.key("trainer.pem"))
    return 2


@hostile(TRUST, "signed", "signature-invalid")
def signed_generation_rewritten_as_format_2(plot: Plot) -> int:
    """The logical manifest stored as format 2 (every chunk in one manifest, no
    index): consistent, but not the bytes the trainer signed."""
    gen = plot.gen(2)
    document = read_logical(gen)
    document["format_version"] = 2
    for index in gen.glob("*-index.json"):
        index.unlink()
    reseal(gen, document)
    return 2


@hostile(TRUST, "encrypted", "manifest-invalid")
def older_index_recorded_in_an_encrypted_generation(plot: Plot) -> int:
    write_index(plot.gen(2), INDEX, plot.index(1).read_bytes())
    return 2


@hostile(TRUST, "encrypted", "manifest-unauthenticated")
def index_chunks_swapped_in_an_encrypted_generation(plot: Plot) -> int:
    """Two tensors of one size trade places in the index (each chunk's file, entry and
    byte range), the root recording the index: every structure check passes; the
    root's MAC, over the index's digest, does not."""

    def swap(tensors: dict) -> None:
        first, second = tensors["model/fc1.bias"][0], tensors["model/norm.bias"][0]
        first[2:], second[2:] = second[2:], first[2:]

    return edit_chunks(plot, swap)


@hostile(TRUST, "signed", "name-mismatch", restores=2)
def signed_generation_with_its_index_republished_as_newer(plot: Plot) -> int:
    copy_generation(plot.gen(1), plot.store, 3, "29990101T000000000000Z-0badc0de")
    return 3


# -- paths and links --------------------------------------------------------------------


@hostile(PATHS, "plain", "unsafe-path")
def root_file_without_a_rank_prefix(plot: Plot) -> int:
    name = plot.tensor_file(2).name
    forge_root(
        plot.gen(2),
        lambda root: root["files"].update({"model.safetensors": root["files"].pop(name)}),
    )
    return 2


@hostile(PATHS, "plain", "unsafe-path")
def traversal_in_the_index_list(plot: Plot) -> int:
    def rename(root: dict) -> None:
        root["indexes"]["../../outside/r00000-index.json"] = root["indexes"].pop(INDEX)

    forge_root(plot.gen(2), rename)
    return 2


@hostile(PATHS, "plain", "unsafe-path")
def absolute_path_in_the_index_list(plot: Plot) -> int:
    def rename(root: dict) -> None:
        root["indexes"][str(plot.outside / INDEX)] = root["indexes"].pop(INDEX)

    forge_root(plot.gen(2), rename)
    return 2


def _chunk_file(plot: Plot, target: str) -> int:
    return edit_chunks(plot, lambda tensors: tensors[FQN][0].__setitem__(2, target))


@hostile(PATHS, "plain", "manifest-invalid")
def traversal_in_an_index_chunk_file(plot: Plot) -> int:
    return _chunk_file(plot, "../../outside/secret.bin")


@hostile(PATHS, "plain", "manifest-invalid")
def absolute_path_in_an_index_chunk_file(plot: Plot) -> int:
    return _chunk_file(plot, str(plot.secret))


@hostile(PATHS, "plain", "manifest-invalid")
def index_chunk_in_the_manifest_itself(plot: Plot) -> int:
    return _chunk_file(plot, "manifest.json")


@hostile(PATHS, "plain", "unsafe-entry")
def index_symlinked_to_identical_bytes(plot: Plot) -> int:
    copy = plot.outside / INDEX
    copy.write_bytes(plot.index(2).read_bytes())  # the root's digest matches
    plot.index(2).unlink()
    plot.index(2).symlink_to(copy)
    return 2


@hostile(PATHS, "plain", "unsafe-entry")
def index_symlinked_to_a_secret(plot: Plot) -> int:
    plot.index(2).unlink()
    plot.index(2).symlink_to(plot.secret)
    return 2


@hostile(PATHS, "signed", "unsafe-entry")
def index_hard_linked_outside(plot: Plot) -> int:
    os.link(plot.index(2), plot.outside / INDEX)  # identical bytes, a second name
    return 2


@hostile(PATHS, "plain", "unsafe-entry")
def index_replaced_by_a_fifo(plot: Plot) -> int:
    plot.index(2).unlink()
    os.mkfifo(plot.index(2))  # a reader that opened it would block forever
    return 2


@hostile(PATHS, "plain", "unsafe-entry")
def index_replaced_by_a_directory(plot: Plot) -> int:
    data = plot.index(2).read_bytes()
    plot.index(2).unlink()
    plot.index(2).mkdir()
    (plot.index(2) / INDEX).write_bytes(data)
    return 2


# -- pickle payloads and malformed JSON in an index -------------------------------------


@hostile(PICKLE, "plain", "manifest-invalid")
def pickle_as_index(plot: Plot) -> int:
    write_index(plot.gen(2), INDEX, pickle_payload(plot.marker))
    return 2


@hostile(PICKLE, "plain", "manifest-invalid")
def torch_save_archive_as_index(plot: Plot) -> int:
    write_index(plot.gen(2), INDEX, torch_save_payload(plot.marker))
    return 2


def _spelled(plot: Plot, encode: Any) -> int:
    return edit_index(plot, None, encode=lambda index: encode(index).encode())


@hostile(JSON, "plain", "manifest-invalid")
def pretty_printed_index(plot: Plot) -> int:
    return _spelled(plot, lambda index: json.dumps(index, indent=1, sort_keys=True))


@hostile(JSON, "plain", "manifest-invalid")
def index_keys_out_of_order(plot: Plot) -> int:
    return _spelled(
        plot, lambda index: json.dumps(dict(reversed(list(index.items()))), separators=(",", ":"))
    )


@hostile(JSON, "plain", "manifest-invalid")
def duplicated_key_in_an_index(plot: Plot) -> int:
    def twice(index: dict) -> str:
        text = json.dumps(index, separators=(",", ":"), sort_keys=True)
        return text.replace('"holder":0,', '"holder":1,"holder":0,')

    return _spelled(plot, twice)


@hostile(JSON, "plain", "manifest-invalid")
def escaped_key_in_an_index(plot: Plot) -> int:
    def escaped(index: dict) -> str:
        text = json.dumps(index, separators=(",", ":"), sort_keys=True)
        return text.replace('"holder":', '"\\u0068older":')

    return _spelled(plot, escaped)


@hostile(JSON, "plain", "manifest-invalid")
def float_spelling_of_the_holder(plot: Plot) -> int:
    return edit_index(plot, lambda index: index.update(holder="@h@"), {"@h@": "0.0"})


@hostile(JSON, "plain", "manifest-invalid")
def byte_order_mark_on_an_index(plot: Plot) -> int:
    data = b"\xef\xbb\xbf" + plot.index(2).read_bytes()
    write_index(plot.gen(2), INDEX, data)
    return 2


@hostile(JSON, "plain", "manifest-invalid")
def invalid_utf8_in_an_index(plot: Plot) -> int:
    data = plot.index(2).read_bytes().replace(b'"run_id":"r"', b'"run_id":"r\xff"')
    write_index(plot.gen(2), INDEX, data)
    return 2


@hostile(JSON, "plain", "manifest-invalid")
def lone_surrogate_in_an_index(plot: Plot) -> int:
    return edit_index(plot, lambda index: index.update(run_id="@s@"), {"@s@": '"\\ud800"'})


@hostile(JSON, "plain", "manifest-invalid")
def nan_in_an_index(plot: Plot) -> int:
    return edit_index(
        plot, lambda index: index["tensors"][FQN][0].__setitem__(4, "@n@"), {"@n@": "NaN"}
    )


@hostile(JSON, "plain", "manifest-invalid")
def deeply_nested_index(plot: Plot) -> int:
    return edit_index(plot, lambda index: index.update(tensors="@d@"), {"@d@": deep(20_000)})


@hostile(JSON, "plain", "manifest-invalid")
def index_one_level_past_its_depth_bound(plot: Plot) -> int:
    """Nested one level deeper than an index ever is (:data:`MAX_INDEX_DEPTH`)."""
    nested = deep(MAX_INDEX_DEPTH - 2)  # inside the index's object and the tensors object
    return edit_index(plot, lambda index: index["tensors"].update(extra="@d@"), {"@d@": nested})


# -- enormous claims in the root's records and table, and in an index ------------------


@hostile(CLAIMS, "plain", "manifest-invalid")
def root_over_32_mib(plot: Plot) -> int:
    """A format-3 root of MAX_ROOT_BYTES and a bit (still under format 2's 64 MiB)."""
    padding = "x" * (MAX_ROOT_BYTES + 1)
    forge_root(plot.gen(2), lambda root: root["contract"].update(padding=padding))
    return 2


@hostile(CLAIMS, "plain", "manifest-invalid")
def index_record_claims_2_to_the_40_bytes(plot: Plot) -> int:
    forge_root(plot.gen(2), lambda root: root["indexes"][INDEX].update(size=2**40))
    return 2


@hostile(CLAIMS, "plain", "manifest-invalid")
def index_record_claims_a_negative_size(plot: Plot) -> int:
    forge_root(plot.gen(2), lambda root: root["indexes"][INDEX].update(size=-1))
    return 2


@hostile(CLAIMS, "plain", "manifest-invalid")
def index_over_64_mib_and_recorded(plot: Plot) -> int:
    """A real index of MAX_INDEX_BYTES and one, the root recording exactly that: it
    is refused from the record, never read."""
    data = plot.index(2).read_bytes()
    write_index(plot.gen(2), INDEX, data + b" " * (MAX_INDEX_BYTES + 1 - len(data)))
    return 2


@hostile(CLAIMS, "plain", "manifest-invalid")
def index_chunk_claims_a_trillion_squared_elements(plot: Plot) -> int:
    return edit_chunks(plot, box([0, 0], [10**12, 10**12]))


@hostile(CLAIMS, "plain", "manifest-inconsistent")
def table_and_index_agree_on_a_32_gib_tensor(plot: Plot) -> int:
    """A consistent claim, root and index alike: only the 512 bytes its file holds
    for it contradict it."""
    shape = [2**30, 8]
    forge_root(plot.gen(2), lambda root: root["tensors"][FQN].update(shape=shape))
    return edit_chunks(plot, box([0, 0], shape))


@hostile(CLAIMS, "plain", "manifest-inconsistent")
def index_chunk_claims_2_to_the_62_bytes(plot: Plot) -> int:
    return edit_chunks(plot, lambda tensors: tensors[FQN][0].__setitem__(5, 2**62))


@hostile(CLAIMS, "plain", "manifest-invalid")
def table_split_into_2_to_the_62_parts(plot: Plot) -> int:
    return edit_table(plot, split=[[0, [[1, 2**62]]]], holders=[[0, 1]])


@hostile(CLAIMS, "plain", "manifest-invalid")
def table_holders_claim_2_to_the_62_cells(plot: Plot) -> int:
    return edit_table(plot, holders=[[0, 2**62]])


@hostile(CLAIMS, "plain", "manifest-invalid")
def table_splits_a_tensor_into_16_million_cells(plot: Plot) -> int:
    """2**24 parts of one row, the cells claimed by one run of holders: refused by
    counting, nothing expanded."""

    def change(root: dict) -> None:
        root["tensors"][FQN].update(shape=[MAX_CELLS, 8], split=[[0, [[1, MAX_CELLS]]]])

    forge_root(plot.gen(2), change)
    return 2


@hostile(CLAIMS, "plain", "manifest-invalid")
def table_claims_more_cells_than_any_root_may(plot: Plot) -> int:
    """4,096 ranks listed (their files absent: the root is refused first) and every
    tensor cut into runs of cells over all of them: each within MAX_CELLS, together
    more than that."""
    ranks = 4096

    def change(root: dict) -> None:
        record = next(iter(root["indexes"].values()))
        size = next(iter(root["files"].values()))
        root["indexes"] = {f"r{r:05d}-index.json": record for r in range(ranks)}
        root["files"] = {f"r{r:05d}-000.safetensors": size for r in range(ranks)}
        runs = -(-(MAX_CELLS // len(root["tensors"]) + 1) // ranks)
        assert runs * ranks <= MAX_CELLS < runs * ranks * len(root["tensors"])
        for info in root["tensors"].values():
            info.pop("chunks", None)
            info.update(shape=[runs * ranks, 1], split=[[0, [[1, runs * ranks]]]])
            info["holders"] = [[0, ranks]] * runs

    forge_root(plot.gen(2), change)
    return 2
