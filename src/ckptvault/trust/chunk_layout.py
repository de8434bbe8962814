"""Chunk layout: the manifest's DCP chunks against the shapes and the tensor files.

Three rules, each a ``manifest-inconsistent`` when broken (the manifest has already
been type-checked: every shape, offset, size, start and length is a plain
non-negative integer, see ``ckptvault.format.records.check_dcp_section``):

- **Every tensor's chunks tile its shape exactly**, at any chunk count: each chunk
  lies inside the shape and every element is covered exactly once. Bytes that were
  never written must never reach a restored tensor; a duplicated chunk next to a
  hole keeps the total volume right, so volume alone proves nothing.
- **Chunks fit their files.** A chunk's ``length`` is its element count times the
  element size, and the chunks of one file occupy disjoint byte ranges inside the
  part of the file that holds tensor data (a plain file: after its header; an
  encrypted one: its container's plaintext). So the tensors a restore allocates
  never take more memory than the generation's files actually hold.
- **Chunks are where the headers say**: in a listed file, at the offset, size,
  dtype and shape of the tensor file header entry they name (plain files here;
  encrypted ones once decrypted, by the reader).

The tiling test is exact and linear. Give each chunk, seen as a box, a signed mark
at each of its corners: +1 or -1 as an even or odd number of the corner's
coordinates are upper bounds. Summing marks over every point at or below ``x``
gives 1 inside a box and 0 outside, so the sum of all chunks' marks, summed that
way, is how many chunks cover ``x``. The chunks therefore cover the shape exactly
once precisely when their marks add up to the shape's own marks. Only dimensions
in which some chunk does not span the whole extent get corners, so sharding along
one dimension costs 2 marks per chunk and a 2-D grid 4, however many chunks there
are. A layout split along many dimensions at once costs ``2**k`` marks per chunk;
the total is bounded, and a manifest beyond that bound is refused rather than
checked for minutes.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Collection, Mapping
from typing import Any

from ckptvault.format.manifest import Manifest
from ckptvault.format.tensorfile import TensorFileHeader, element_size
from ckptvault.trust.problems import MANIFEST_INCONSISTENT, Problem

# Corner marks a manifest may cost: real layouts (split along at most 3 dimensions)
# need at most 8 per chunk and always fit.
CORNER_BUDGET_BASE = 1 << 21
CORNER_BUDGET_PER_CHUNK = 8


def _label(fqn: str) -> str:
    return repr(fqn if len(fqn) <= 200 else fqn[:200] + "...")


def check_chunk_layout(
    manifest: Manifest,
    headers: Mapping[str, TensorFileHeader],
    regions: Mapping[str, tuple[int, int]],
    files: Collection[str] | None = None,
) -> list[Problem]:
    """Every rule of this module, for a whole generation (or the chunks in ``files``).

    ``headers`` are the parsed headers of the plain tensor files; ``regions`` maps
    every tensor file to the ``[first, end)`` byte range that may hold tensor data.
    A format-3 manifest's tiling is proven by its root's tensor table and each index's
    cells (:mod:`ckptvault.trust.indexes`), so only the other rules apply to it.
    """
    tensors: dict[str, Any] = manifest.dcp["tensors"]
    budget = CORNER_BUDGET_BASE + CORNER_BUDGET_PER_CHUNK * sum(
        len(info["chunks"]) for info in tensors.values()
    )
    problems = []
    spans: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for fqn, info in tensors.items():
        if not manifest.indexed:
            tiling, cost = _tiling_problem(info["shape"], info["chunks"], budget)
            budget -= cost
            if tiling is not None:
                problems.append(Problem(MANIFEST_INCONSISTENT, f"tensor {_label(fqn)}: {tiling}"))
                continue
        item = element_size(info["dtype"])
        for chunk in info["chunks"]:
            file, start, length = chunk["file"], chunk["start"], chunk["length"]
            if files is not None and file not in files and file in manifest.files:
                continue  # checked with its own index's files
            if file not in manifest.files:
                problems.append(
                    Problem(
                        MANIFEST_INCONSISTENT,
                        f"tensor {_label(fqn)} lives in unlisted file {file[:200]}",
                    )
                )
            elif file not in regions:
                problems.append(
                    Problem(
                        MANIFEST_INCONSISTENT,
                        f"tensor {_label(fqn)} lives in {file}, which holds no tensors",
                        file,
                    )
                )
            elif length != math.prod(chunk["sizes"]) * item:
                problems.append(
                    Problem(
                        MANIFEST_INCONSISTENT,
                        f"tensor {_label(fqn)} chunk {chunk['offsets']} records {length} bytes, "
                        f"but {chunk['sizes']} elements of {info['dtype']} take "
                        f"{math.prod(chunk['sizes']) * item}",
                        file,
                    )
                )
            else:
                spans[file].append((start, start + length, fqn))
    for file, file_spans in sorted(spans.items()):
        problem = _span_problem(file, file_spans, regions[file])
        if problem is not None:
            problems.append(problem)
    if problems:
        return problems
    return check_chunk_locations(manifest, headers)


def check_chunk_locations(
    manifest: Manifest, headers: Mapping[str, TensorFileHeader]
) -> list[Problem]:
    """Tie the manifest's DCP chunks to the tensor file headers, for the files in
    ``headers`` (the reader checks each encrypted file's once it is decrypted)."""
    problems = []
    tensors = manifest.dcp["tensors"]
    for file, header in headers.items():
        for fqn, chunk in manifest.chunks_by_file.get(file, ()):
            info, name = tensors[fqn], chunk["name"]
            found = header.entries.get(name)
            if (
                found is None
                or found.start != chunk["start"]
                or found.nbytes != chunk["length"]
                or found.dtype != info["dtype"]
                or list(found.shape) != list(chunk["sizes"])
            ):
                problems.append(
                    Problem(
                        MANIFEST_INCONSISTENT,
                        f"tensor {_label(fqn)} chunk {chunk['offsets']} is not where the manifest "
                        f"says ({file}:{name[:200]})",
                        file,
                    )
                )
    return problems


def _span_problem(
    file: str, spans: list[tuple[int, int, str]], region: tuple[int, int]
) -> Problem | None:
    """Chunks of one file must sit inside its data region without sharing a byte."""
    first, end = region
    spans.sort()
    previous_end, previous = first, None
    for start, stop, fqn in spans:
        if start < first or stop > end:
            return Problem(
                MANIFEST_INCONSISTENT,
                f"tensor {_label(fqn)} is placed at bytes {start}..{stop} of {file}, outside "
                f"the {first}..{end} that hold tensor data",
                file,
            )
        if start < previous_end and stop > start:
            return Problem(
                MANIFEST_INCONSISTENT,
                f"tensors {_label(fqn)} and {_label(previous or fqn)} share bytes of {file} "
                f"(at {start})",
                file,
            )
        if stop > start:
            previous_end, previous = stop, fqn
    return None


def tiling_problem(shape: list[int], chunks: list[dict[str, Any]]) -> str | None:
    """Why ``chunks`` (each with ``offsets`` and ``sizes``) do not cover ``shape``
    exactly once, or None; one tensor, with the budget a manifest of those chunks
    would get."""
    budget = CORNER_BUDGET_BASE + CORNER_BUDGET_PER_CHUNK * len(chunks)
    return _tiling_problem(shape, chunks, budget)[0]


def _tiling_problem(
    shape: list[int], chunks: list[dict[str, Any]], budget: int
) -> tuple[str | None, int]:
    """Why ``chunks`` do not cover ``shape`` exactly once (or None), and the corner
    marks that took. See the module docstring for the test."""
    rank = len(shape)
    if len(chunks) == 1 and budget >= 1:
        # One chunk spanning the whole shape (every tensor a single process saves):
        # the general test below would find no split dimension and one matching
        # corner; same answer, same cost, without building them.
        offsets, sizes = chunks[0]["offsets"], chunks[0]["sizes"]
        if sizes == shape and len(offsets) == rank and not any(offsets):
            return None, 1 if all(sizes) else 0
    boxes = []
    for chunk in chunks:
        offsets, sizes = chunk["offsets"], chunk["sizes"]
        if len(offsets) != rank or len(sizes) != rank:
            return f"chunk {offsets} has the wrong rank", 0
        if any(o + s > d for o, s, d in zip(offsets, sizes, shape, strict=True)):
            return f"chunk {offsets}+{sizes} lies outside the shape {shape}", 0
        if all(sizes):  # an empty chunk holds no element (and no byte)
            boxes.append((offsets, sizes))
    volume = math.prod(shape)
    covered = sum(math.prod(sizes) for _, sizes in boxes)
    if covered != volume:
        what = "overlap" if covered > volume else "leave a gap"
        return (
            f"its chunks cover {covered} elements of a shape {shape} with {volume}: they {what}",
            0,
        )
    if not volume:
        return None, 0
    split = [
        dim
        for dim in range(rank)
        if any(offsets[dim] != 0 or sizes[dim] != shape[dim] for offsets, sizes in boxes)
    ]
    cost = len(boxes) << len(split)
    if cost > budget:
        return (
            f"its {len(boxes)} chunks are split along {len(split)} dimensions, more than "
            "ckptvault checks (it never writes such a layout)",
            0,
        )
    marks: dict[tuple[int, ...], int] = defaultdict(int)
    for offsets, sizes in boxes:
        bounds = [((offsets[d], 1), (offsets[d] + sizes[d], -1)) for d in split]
        for corner in itertools.product(*bounds):
            marks[tuple(c for c, _ in corner)] += math.prod(sign for _, sign in corner)
    expected = {
        tuple(c for c, _ in corner): math.prod(sign for _, sign in corner)
        for corner in itertools.product(*[((0, 1), (shape[d], -1)) for d in split])
    }
    if {point: mark for point, mark in marks.items() if mark} != expected:
        return (
            f"its chunks overlap and leave a gap of the same size in the shape {shape} "
            "(a duplicated chunk next to a hole)",
            cost,
        )
    return None, cost
