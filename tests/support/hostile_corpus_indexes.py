"""Corpus entries (see :mod:`hostile_corpus`) aimed at format 3's own structures: the
root's index records and tensor table, the indexes themselves, what they name, how
they are spelled and what kind of file they are.

An index is refused before a byte of it is parsed when it does not match the root's
record of it (``digest-mismatch``, ``size-mismatch``, ``file-missing``,
``file-extra``); when it parses but says something the root does not (another
generation, run or rank, other files) it is ``manifest-invalid``; chunk digests
that do not derive the root's file digests are ``digest-mismatch``; chunks that are
not exactly the cells the tensor table gives the index, and a listed table that
does not tile, are ``manifest-inconsistent``. Most entries forge an unsigned
generation, refreshing the root's record of the index as anyone who can write the
store can (:func:`hostile_forging.forge_index`).
"""

from __future__ import annotations

import json
from typing import Any

from support.forging import read_logical
from support.hostile_corpus import INDEXES, hostile
from support.hostile_forging import forge_index, record_of, write_index
from support.hostile_plants import (
    Plot,
    forge_root,
    generation_id,
    replace_bytes,
)

FQN = "model/fc1.weight"  # [16, 8]: one chunk, one cell, in rank 0's index
INDEX = "r00000-index.json"

# -- the index against the root's record of it ------------------------------------------


@hostile(INDEXES, "plain", "digest-mismatch")
def index_with_a_flipped_byte(plot: Plot) -> int:
    data = bytearray(plot.index(2).read_bytes())
    data[len(data) // 2] ^= 0x01
    replace_bytes(plot.index(2), bytes(data))
    return 2


@hostile(INDEXES, "plain", "digest-mismatch")
def index_swapped_from_another_generation(plot: Plot) -> int:
    older = plot.index(1).read_bytes()
    assert len(older) == plot.index(2).stat().st_size  # else the listing refuses it first
    replace_bytes(plot.index(2), older)
    return 2


@hostile(INDEXES, "plain", "manifest-invalid")
def index_swapped_from_another_generation_and_recorded(plot: Plot) -> int:
    """The root vouches for the older generation's index: it names that generation."""
    write_index(plot.gen(2), INDEX, plot.index(1).read_bytes())
    return 2


@hostile(INDEXES, "plain", "file-missing")
def index_missing(plot: Plot) -> int:
    plot.index(2).unlink()
    return 2


@hostile(INDEXES, "plain", "file-extra")
def extra_index(plot: Plot) -> int:
    (plot.gen(2) / "r00001-index.json").write_bytes(plot.index(2).read_bytes())
    return 2


@hostile(INDEXES, "plain", "manifest-invalid")
def extra_index_recorded_for_a_rank_without_files(plot: Plot) -> int:
    data = plot.index(2).read_bytes()
    (plot.gen(2) / "r00001-index.json").write_bytes(data)
    forge_root(
        plot.gen(2), lambda root: root["indexes"].update({"r00001-index.json": record_of(data)})
    )
    return 2


@hostile(INDEXES, "plain", "manifest-invalid")
def data_file_of_a_rank_without_an_index(plot: Plot) -> int:
    name = plot.tensor_file(2).name
    forge_root(
        plot.gen(2),
        lambda root: root["files"].update({"r00001-000.safetensors": root["files"][name]}),
    )
    return 2


@hostile(INDEXES, "plain", "unsafe-path")
def index_listed_as_a_data_file(plot: Plot) -> int:
    record = {"size": plot.index(2).stat().st_size, "blake3": "0" * 64}
    forge_root(plot.gen(2), lambda root: root["files"].update({INDEX: record}))
    return 2


@hostile(INDEXES, "plain", "manifest-invalid")
def root_lists_no_index(plot: Plot) -> int:
    forge_root(plot.gen(2), lambda root: root.update(indexes={}))
    return 2


@hostile(INDEXES, "plain", "size-mismatch")
def index_longer_than_its_record(plot: Plot) -> int:
    replace_bytes(plot.index(2), plot.index(2).read_bytes() + b" " * 64)
    return 2


# -- what the index names ---------------------------------------------------------------


def edit_index(plot: Plot, change: Any, raw: dict[str, str] | None = None, **options: Any) -> int:
    forge_index(plot.gen(2), change, raw, **options)
    return 2


@hostile(INDEXES, "plain", "manifest-invalid")
def index_names_another_generation(plot: Plot) -> int:
    other = generation_id(plot.gen(1))
    return edit_index(plot, lambda index: index.update(generation_id=other))


@hostile(INDEXES, "plain", "manifest-invalid")
def index_names_another_run(plot: Plot) -> int:
    return edit_index(plot, lambda index: index.update(run_id="other"))


@hostile(INDEXES, "plain", "manifest-invalid")
def index_names_another_rank(plot: Plot) -> int:
    return edit_index(plot, lambda index: index.update(holder=1))


@hostile(INDEXES, "plain", "manifest-invalid")
def index_of_format_version_2(plot: Plot) -> int:
    return edit_index(plot, lambda index: index.update(format_version=2))


@hostile(INDEXES, "plain", "manifest-invalid")
def index_with_an_unknown_key(plot: Plot) -> int:
    return edit_index(plot, lambda index: index.update(chunks=[]))


@hostile(INDEXES, "plain", "manifest-invalid")
def index_lists_a_file_the_root_does_not(plot: Plot) -> int:
    return edit_index(plot, lambda index: index["files"].update({"r00000-999.safetensors": []}))


@hostile(INDEXES, "plain", "manifest-invalid")
def index_omits_its_file(plot: Plot) -> int:
    return edit_index(plot, lambda index: index.update(files={}))


@hostile(INDEXES, "plain", "manifest-invalid")
def index_holds_a_tensor_the_root_does_not_list(plot: Plot) -> int:
    return edit_index(plot, lambda index: index["tensors"].update({"ghost": index["tensors"][FQN]}))


# -- its chunk digests ------------------------------------------------------------------


def edit_digests(plot: Plot, change: Any) -> int:
    name = plot.tensor_file(2).name
    return edit_index(plot, lambda index: change(index["files"][name]))


@hostile(INDEXES, "plain", "digest-mismatch")
def index_chunk_digests_do_not_derive_the_root(plot: Plot) -> int:
    return edit_digests(plot, lambda digests: digests.__setitem__(0, "0" * 64))


@hostile(INDEXES, "plain", "digest-mismatch")
def index_lists_one_chunk_digest_too_many(plot: Plot) -> int:
    return edit_digests(plot, lambda digests: digests.append(digests[0]))


@hostile(INDEXES, "plain", "manifest-invalid")
def index_chunk_digest_is_not_hex(plot: Plot) -> int:
    return edit_digests(plot, lambda digests: digests.__setitem__(0, "Z" * 64))


# -- its chunks against the table's cells -----------------------------------------------


def edit_chunks(plot: Plot, change: Any) -> int:
    return edit_index(plot, lambda index: change(index["tensors"]))


def box(offsets: list[int], sizes: list[int]) -> Any:
    def move(tensors: dict) -> None:
        tensors[FQN][0][:2] = [offsets, sizes]

    return move


@hostile(INDEXES, "plain", "manifest-inconsistent")
def index_chunk_moved(plot: Plot) -> int:
    """Its second half, not the whole tensor the table's one cell is."""
    return edit_chunks(plot, box([8, 0], [8, 8]))


@hostile(INDEXES, "plain", "manifest-invalid")
def index_chunk_outside_the_shape(plot: Plot) -> int:
    return edit_chunks(plot, box([1, 0], [16, 8]))


@hostile(INDEXES, "plain", "manifest-inconsistent")
def index_chunk_shrunk(plot: Plot) -> int:
    return edit_chunks(plot, lambda tensors: tensors[FQN][0].__setitem__(1, [15, 8]))


@hostile(INDEXES, "plain", "manifest-inconsistent")
def index_chunk_duplicated(plot: Plot) -> int:
    return edit_chunks(plot, lambda tensors: tensors[FQN].append(tensors[FQN][0]))


@hostile(INDEXES, "plain", "manifest-inconsistent")
def index_chunk_missing(plot: Plot) -> int:
    return edit_chunks(plot, lambda tensors: tensors.update({FQN: []}))


@hostile(INDEXES, "plain", "manifest-inconsistent")
def index_tensor_missing(plot: Plot) -> int:
    return edit_chunks(plot, lambda tensors: tensors.pop(FQN))


@hostile(INDEXES, "plain", "manifest-inconsistent")
def index_one_chunk_extra(plot: Plot) -> int:
    def extra(tensors: dict) -> None:
        file, name, start = tensors[FQN][0][2:5]
        tensors[FQN].append([[0, 0], [1, 8], file, name, start, 32])

    return edit_chunks(plot, extra)


@hostile(INDEXES, "encrypted", "manifest-inconsistent")
def index_chunk_moved_in_an_encrypted_generation(plot: Plot) -> int:
    """Found before the MAC is checked (that needs the key store): the structure
    checks come first, and refuse it on their own."""
    return edit_chunks(plot, box([8, 0], [8, 8]))


# -- the root's tensor table ------------------------------------------------------------


def edit_table(plot: Plot, **layout: Any) -> int:
    def change(root: dict) -> None:
        info = root["tensors"][FQN]
        for key in ("split", "holders", "chunks"):
            info.pop(key, None)
        info.update(layout)

    forge_root(plot.gen(2), change)
    return 2


@hostile(INDEXES, "plain", "manifest-invalid")
def table_holders_name_an_index_the_root_does_not_list(plot: Plot) -> int:
    return edit_table(plot, holders=[[1, 1]])


@hostile(INDEXES, "plain", "manifest-invalid")
def table_split_parts_do_not_add_up_to_the_shape(plot: Plot) -> int:
    return edit_table(plot, split=[[0, [[4, 3]]]], holders=[[0, 1], [0, 1], [0, 1]])


@hostile(INDEXES, "plain", "manifest-invalid")
def table_split_along_a_dimension_outside_the_shape(plot: Plot) -> int:
    return edit_table(plot, split=[[2, [[1, 8]]]], holders=[[0, 1]] * 8)


@hostile(INDEXES, "plain", "manifest-invalid")
def table_with_an_empty_split(plot: Plot) -> int:
    return edit_table(plot, split=[], holders=[[0, 1]])


@hostile(INDEXES, "plain", "manifest-invalid")
def table_with_holders_and_chunks(plot: Plot) -> int:
    return edit_table(plot, holders=[[0, 1]], chunks=[[[0, 0], [16, 8], 0]])


@hostile(INDEXES, "plain", "manifest-inconsistent")
def table_grid_the_index_does_not_follow(plot: Plot) -> int:
    """Two cells of 8 rows, both rank 0's; its index holds one chunk of 16."""
    return edit_table(plot, split=[[0, [[8, 2]]]], holders=[[0, 1], [0, 1]])


@hostile(INDEXES, "plain", "manifest-inconsistent")
def listed_table_that_leaves_a_gap(plot: Plot) -> int:
    return edit_table(plot, chunks=[[[0, 0], [8, 8], 0]])


@hostile(INDEXES, "plain", "manifest-inconsistent")
def listed_table_that_overlaps(plot: Plot) -> int:
    return edit_table(plot, chunks=[[[0, 0], [16, 8], 0], [[8, 0], [8, 8], 0]])


@hostile(INDEXES, "plain", "manifest-inconsistent")
def listed_table_with_a_duplicate_next_to_a_hole(plot: Plot) -> int:
    return edit_table(plot, chunks=[[[0, 0], [8, 8], 0], [[0, 0], [8, 8], 0]])


@hostile(INDEXES, "plain", "manifest-invalid")
def listed_table_chunk_holding_no_element(plot: Plot) -> int:
    return edit_table(plot, chunks=[[[0, 0], [16, 8], 0], [[16, 0], [0, 8], 0]])


@hostile(INDEXES, "plain", "manifest-inconsistent")
def table_lists_a_tensor_no_index_holds(plot: Plot) -> int:
    ghost = {"dtype": "float32", "shape": [2], "holders": [[0, 1]]}
    forge_root(plot.gen(2), lambda root: root["tensors"].update(ghost=ghost))
    return 2


@hostile(INDEXES, "plain", "manifest-invalid")
def table_omits_a_tensor_the_index_holds(plot: Plot) -> int:
    forge_root(plot.gen(2), lambda root: root["tensors"].pop(FQN))
    return 2


@hostile(INDEXES, "plain", "manifest-inconsistent")
def table_shape_disagrees_with_the_index(plot: Plot) -> int:
    forge_root(plot.gen(2), lambda root: root["tensors"][FQN].update(shape=[16, 9]))
    return 2


# -- the root's own keys ----------------------------------------------------------------


@hostile(INDEXES, "plain", "manifest-invalid")
def unknown_key_in_the_root(plot: Plot) -> int:
    forge_root(plot.gen(2), lambda root: root.update(evil={"run": "anything"}))
    return 2


@hostile(INDEXES, "plain", "manifest-invalid")
def format_2_dcp_section_in_a_format_3_root(plot: Plot) -> int:
    """Every chunk where format 2 kept them, beside the indexes that hold them."""
    dcp = read_logical(plot.gen(2))["dcp"]
    forge_root(plot.gen(2), lambda root: root.update(dcp=dcp))
    return 2


@hostile(INDEXES, "plain", "manifest-invalid")
def root_without_its_tensor_table(plot: Plot) -> int:
    forge_root(plot.gen(2), lambda root: root.pop("tensors"))
    return 2


@hostile(INDEXES, "plain", "manifest-invalid")
def root_file_record_with_chunk_digests(plot: Plot) -> int:
    name, digests = plot.tensor_file(2).name, json.loads(plot.index(2).read_bytes())["files"]
    forge_root(plot.gen(2), lambda root: root["files"][name].update(chunks=digests[name]))
    return 2


@hostile(INDEXES, "plain", "manifest-invalid")
def format_3_root_relabelled_as_format_2(plot: Plot) -> int:
    forge_root(plot.gen(2), lambda root: root.update(format_version=2))
    return 2


@hostile(INDEXES, "plain", "manifest-invalid", formats=(2,))
def format_2_manifest_relabelled_as_format_3(plot: Plot) -> int:
    forge_root(plot.gen(2), lambda manifest: manifest.update(format_version=3))
    return 2


@hostile(INDEXES, "plain", "unsafe-path")
def index_name_not_of_a_rank(plot: Plot) -> int:
    def rename(root: dict) -> None:
        root["indexes"]["index.json"] = root["indexes"].pop(INDEX)

    forge_root(plot.gen(2), rename)
    return 2


@hostile(INDEXES, "plain", "unsafe-path")
def rank_prefix_spelled_with_six_digits(plot: Plot) -> int:
    """``r000000-`` is not rank 0's prefix: one spelling per rank."""
    name = plot.tensor_file(2).name

    def rename(root: dict) -> None:
        root["files"]["r0" + name[1:]] = root["files"].pop(name)

    forge_root(plot.gen(2), rename)
    return 2
