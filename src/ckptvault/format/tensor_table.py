"""The root manifest's tensor table: every tensor's dtype, shape and chunk grid, and
which index holds each chunk — in a size that does not grow with ranks x tensors.

A tensor sharded over N ranks has N chunks. Listing each (offsets, sizes, file,
byte range, digests) in the root would make the root grow with ranks x tensors, so
format version 3 lists chunks only in the per-rank indexes
(:mod:`ckptvault.format.index`) and keeps here just enough to know, before any
index is read, which index holds which part of every tensor:

- ``split``: the dimensions along which the tensor is cut, each as run-length
  encoded part sizes, ``[[dim, [[size, count], ...]], ...]``. The chunks are the
  cells of that grid, numbered in row-major order over the split dimensions. An
  even split of 4,096 rows over 1,024 ranks is ``[[0, [[4, 1024]]]]`` whatever N.
  An unsplit tensor has no ``split`` and one cell.
- ``holders``: the index holding each cell, run-length encoded as ``[[first,
  count], ...]``: cells ``c .. c+count-1`` are held by indexes ``first ..
  first+count-1``. A tensor whose shard ``i`` rank ``i`` wrote is ``[[0, N]]``.
- ``chunks`` instead of both, for a layout that is not such a grid:
  ``[[offsets, sizes, holder], ...]``, one per chunk, checked to tile the shape.

Chunks that hold no element (an empty shard) are no cells; only their index lists
them. Parsing bounds every count before anything is expanded: a root names at most
:data:`MAX_CELLS` cells in all. Nor is anything expanded afterwards: which index
holds a given cell (:meth:`TensorLayout.cell_holder`), which indexes hold any cell
of a box (:meth:`TensorLayout.holders_of`) and how many cells an index holds
(:meth:`TensorTable.cells_held`) are bisections over the runs as the root spells
them, so a planted root of a few runs over 2**24 cells costs what its runs cost.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ckptvault.errors import FormatError
from ckptvault.format.canonical import dumps_canonical
from ckptvault.format.tensorfile import (
    DTYPES,
    MAX_TENSOR_BYTES,
    MAX_TENSOR_RANK,
    checked_shape,
    element_size,
)

MAX_CELLS = 1 << 24  # chunks a root may assign to indexes, over all its tensors
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


@dataclass(frozen=True)
class Runs:
    """A run-length encoded sequence: ``[[value, count], ...]``, with each value's
    meaning left to the caller (part sizes, or first holders). ``totals`` are the sums
    of ``value * count`` before each run (for part sizes: where each run's first part
    begins), so that any part is found by bisection, never by a scan."""

    pairs: tuple[tuple[int, int], ...]
    starts: tuple[int, ...]  # position of each run's first element
    totals: tuple[int, ...]  # sum of value * count over the runs before each

    @classmethod
    def of(cls, pairs: Sequence[tuple[int, int]]) -> Runs:
        starts, totals, position, total = [], [], 0, 0
        for value, count in pairs:
            starts.append(position)
            totals.append(total)
            position += count
            total += value * count
        return cls(tuple(pairs), tuple(starts), tuple(totals))

    @property
    def length(self) -> int:
        if not self.pairs:
            return 0
        return self.starts[-1] + self.pairs[-1][1]

    @property
    def total(self) -> int:
        """The sum of every element (for part sizes: the extent they cover)."""
        if not self.pairs:
            return 0
        return self.totals[-1] + self.pairs[-1][0] * self.pairs[-1][1]

    def run_at(self, position: int) -> int:
        return bisect.bisect_right(self.starts, position) - 1

    def part_at(self, coordinate: int) -> int:
        """For part sizes: the part holding ``coordinate`` (``0 <= coordinate < total``)."""
        run = bisect.bisect_right(self.totals, coordinate) - 1
        return self.starts[run] + (coordinate - self.totals[run]) // self.pairs[run][0]


@dataclass(frozen=True)
class TensorLayout:
    """One tensor of the table (see the module docstring)."""

    dtype: str
    shape: tuple[int, ...]
    split: tuple[tuple[int, Runs], ...] = ()  # (dim, part sizes)
    holders: Runs | None = None  # grid form
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...] | None = None  # explicit

    @property
    def cell_count(self) -> int:
        if self.chunks is not None:
            return len(self.chunks)
        if not math.prod(self.shape):
            return 0
        return math.prod(parts.length for _dim, parts in self.split)

    def holder_spans(self) -> Iterator[tuple[int, int]]:
        """``[first, end)`` ranges of index ordinals covering every cell's holder, one per
        holder run (or listed chunk): as many as the root spells out, never one per cell."""
        if self.chunks is not None:
            yield from ((holder, holder + 1) for _o, _s, holder in self.chunks)
        elif self.holders is not None:
            yield from ((first, first + count) for first, count in self.holders.pairs)

    def all_holders(self) -> set[int]:
        """Every index that holds a cell of this tensor, each once (from its holder
        runs: never one step per cell)."""
        return _ordinals(self.holder_spans())

    def cells_of(self, holder: int) -> Iterator[Box]:
        """The box of every cell index ``holder`` holds (a walk over every holder run:
        for tools and tests, not for checking an index; see :meth:`cell_holder`)."""
        if self.chunks is not None:
            yield from ((o, s) for o, s, h in self.chunks if h == holder)
            return
        assert self.holders is not None
        for (first, count), start in zip(self.holders.pairs, self.holders.starts, strict=True):
            if first <= holder < first + count:
                yield self._cell_box(start + holder - first)

    def cell_holder(self, offsets: Sequence[int], sizes: Sequence[int]) -> int | None:
        """The index holding the cell that is exactly the box ``offsets``+``sizes``, or
        None when that box is no cell of this tensor. Costs a bisection per dimension
        (a dictionary look-up for a listed layout), whatever the grid's size."""
        if len(offsets) != len(self.shape) or len(sizes) != len(self.shape):
            return None
        if self.chunks is not None:
            return self._listed.get((tuple(offsets), tuple(sizes)))
        assert self.holders is not None
        if not math.prod(self.shape):
            return None
        position = 0
        for dim, extent in enumerate(self.shape):
            parts = self._split_at.get(dim)
            if parts is None:
                if offsets[dim] != 0 or sizes[dim] != extent:
                    return None
                continue
            if not 0 <= offsets[dim] < extent:
                return None
            part = parts.part_at(offsets[dim])
            if _part_span(parts, part) != (offsets[dim], sizes[dim]):
                return None
            position = position * parts.length + part
        run = self.holders.run_at(position)
        return self.holders.pairs[run][0] + position - self.holders.starts[run]

    @functools.cached_property
    def _split_at(self) -> dict[int, Runs]:
        return dict(self.split)

    @functools.cached_property
    def _listed(self) -> dict[Box, int]:
        """A listed layout's chunks by box (the tiling check refuses repeated boxes)."""
        assert self.chunks is not None
        return {(o, s): h for o, s, h in self.chunks}

    def holders_of(self, offsets: Sequence[int], sizes: Sequence[int]) -> set[int]:
        """The indexes holding any cell that overlaps the box ``offsets``+``sizes``.

        The cells of a grid that overlap a box are a product of part ranges; their
        row-major positions are contiguous across the trailing dimensions the box
        spans whole, so they are walked as spans of positions, each matched against
        the holder runs by bisection: the cost grows with the spans and runs the box
        meets, never with the cells in it."""
        if len(offsets) != len(self.shape) or len(sizes) != len(self.shape):
            return self.all_holders()
        if not all(sizes) or not _overlaps(offsets, sizes, (0,) * len(self.shape), self.shape):
            return set()  # no element of the tensor (an empty box, or one beside it)
        if self.chunks is not None:
            return {h for o, s, h in self.chunks if _overlaps(o, s, offsets, sizes)}
        if not self.split:
            return self.all_holders()  # one cell, the whole tensor
        ranges = [
            _parts_overlapping(parts, offsets[dim], offsets[dim] + sizes[dim])
            for dim, parts in self.split
        ]
        lengths = [parts.length for _dim, parts in self.split]
        # The last split dimension the box does not span whole (the first when it spans
        # them all): for each choice of parts before it, the cells are one span.
        cut = len(ranges) - 1
        while cut > 0 and len(ranges[cut]) == lengths[cut]:
            cut -= 1
        stride = math.prod(lengths[cut + 1 :])
        spans: list[tuple[int, int]] = []
        for leading in itertools.product(*ranges[:cut]):
            base = 0
            for part, length in zip(leading, lengths, strict=False):
                base = base * length + part
            base *= lengths[cut] * stride
            low, high = base + ranges[cut].start * stride, base + ranges[cut].stop * stride
            spans.extend(self._holder_spans_between(low, high))
        return _ordinals(spans)

    def _holder_spans_between(self, low: int, high: int) -> Iterator[tuple[int, int]]:
        """``[first, end)`` ranges of the holders of cell positions ``low .. high-1``."""
        assert self.holders is not None
        run = self.holders.run_at(low)
        while run < len(self.holders.pairs) and self.holders.starts[run] < high:
            (first, count), start = self.holders.pairs[run], self.holders.starts[run]
            lo, hi = max(low, start), min(high, start + count)
            if lo < hi:
                yield first + lo - start, first + hi - start
            run += 1

    def _cell_box(self, position: int) -> Box:
        offsets, sizes = [0] * len(self.shape), list(self.shape)
        for dim, parts in reversed(self.split):
            position, part = divmod(position, parts.length)
            offsets[dim], sizes[dim] = _part_span(parts, part)
        return tuple(offsets), tuple(sizes)

    def encoded(self) -> bytes:
        """``dumps_canonical(self.to_json())``; written out directly for a tensor
        stored whole (one cell, one holder: what a one-process save has)."""
        holders = self.holders
        if (
            not self.split
            and holders is not None
            and len(holders.pairs) == 1
            and self.dtype in DTYPES  # a plain name: nothing to escape
        ):
            (first, count), dims = holders.pairs[0], ",".join(map(str, self.shape))
            if count == 1:
                return (
                    f'{{"dtype":"{self.dtype}","holders":[[{first},1]],"shape":[{dims}]}}'.encode()
                )
        return dumps_canonical(self.to_json())

    def to_json(self) -> dict[str, Any]:
        document: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape)}
        if self.chunks is not None:
            document["chunks"] = [[list(o), list(s), h] for o, s, h in self.chunks]
            return document
        assert self.holders is not None
        document["holders"] = [list(pair) for pair in self.holders.pairs]
        if self.split:
            document["split"] = [[dim, [list(p) for p in parts.pairs]] for dim, parts in self.split]
        return document


def _overlaps(o1: Sequence[int], s1: Sequence[int], o2: Sequence[int], s2: Sequence[int]) -> bool:
    return all(a < b + t and b < a + s for a, s, b, t in zip(o1, s1, o2, s2, strict=True))


def _part_span(parts: Runs, part: int) -> tuple[int, int]:
    """(offset, size) of part number ``part`` of a dimension."""
    run = parts.run_at(part)
    size = parts.pairs[run][0]
    return parts.totals[run] + size * (part - parts.starts[run]), size


def _parts_overlapping(parts: Runs, low: int, high: int) -> range:
    """The parts of a dimension that overlap ``[low, high)`` (by bisection)."""
    low, high = max(low, 0), min(high, parts.total)
    if low >= high:
        return range(0)
    return range(parts.part_at(low), parts.part_at(high - 1) + 1)


def _ordinals(spans: Iterable[tuple[int, int]]) -> set[int]:
    """The index ordinals in the union of ``[first, end)`` spans, each added once
    however often the spans repeat it."""
    found: set[int] = set()
    reached = -1
    for first, end in sorted(spans):
        first = max(first, reached)
        if first < end:
            found.update(range(first, end))
            reached = end
    return found


@dataclass
class TensorTable:
    """The root's ``tensors`` section, parsed or built; its encoding is kept."""

    tensors: dict[str, TensorLayout]
    _encoded: bytes | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        return {fqn: layout.to_json() for fqn, layout in sorted(self.tensors.items())}

    def encoded(self) -> bytes:
        """``dumps_canonical(self.to_json())``, encoded a tensor at a time (no document
        of 10,000 dicts built first for Python's collector to walk), and kept."""
        if self._encoded is None:
            pieces = (
                dumps_canonical(fqn) + b":" + layout.encoded()
                for fqn, layout in sorted(self.tensors.items())
            )
            self._encoded = b"{" + b",".join(pieces) + b"}"
        return self._encoded

    def cells_held(self, holder: int) -> int:
        """How many cells, over every tensor, the table gives index ``holder``: a
        bisection into :meth:`_cell_counts`, however many cells and indexes there are."""
        points, counts = self._cell_counts
        at = bisect.bisect_right(points, holder) - 1
        return counts[at] if at >= 0 else 0

    @functools.cached_property
    def _cell_counts(self) -> tuple[list[int], list[int]]:
        """Cells per index ordinal as a step function: ``counts[i]`` cells for every
        ordinal in ``[points[i], points[i+1])``. Each holder run gives each ordinal
        it spans one cell, so this costs a sort of the runs the root spells out."""
        steps: dict[int, int] = defaultdict(int)
        for layout in self.tensors.values():
            for first, end in layout.holder_spans():
                steps[first] += 1
                steps[end] -= 1
        points, counts, running = [], [], 0
        for point in sorted(steps):
            running += steps[point]
            points.append(point)
            counts.append(running)
        return points, counts


# -- building (the writer) -------------------------------------------------------------


def build_tensor_table(
    tensors: Mapping[str, Any], holder_of_file: Callable[[str], int]
) -> TensorTable:
    """The table of a ``dcp`` section (:mod:`ckptvault.io.dcp_metadata`'s form):
    each tensor's chunks as a grid when they form one, else listed."""
    table = {}
    single: dict[int, Runs] = {}  # holder -> [[holder, 1]]: one Runs for every whole tensor
    for fqn, info in tensors.items():
        shape = tuple(info["shape"])
        whole = _whole(info["dtype"], shape, info["chunks"], holder_of_file, single)
        if whole is not None:
            table[fqn] = whole
            continue
        chunks = [
            (tuple(c["offsets"]), tuple(c["sizes"]), holder_of_file(c["file"]))
            for c in info["chunks"]
            if math.prod(c["sizes"])
        ]
        table[fqn] = _grid(info["dtype"], shape, chunks) or TensorLayout(
            info["dtype"], shape, chunks=tuple(sorted(chunks))
        )
    return TensorTable(table)


def whole_tensor(
    dtype: str, shape: tuple[int, ...], holder: int, single: dict[int, Runs]
) -> TensorLayout:
    """The layout of a non-empty tensor stored whole by index ``holder`` (what
    :func:`_grid` makes of its one chunk); ``single`` shares each holder's runs."""
    runs = single.get(holder)
    if runs is None:
        runs = single[holder] = Runs.of([(holder, 1)])
    return TensorLayout(dtype, shape, (), runs)


def _whole(
    dtype: str,
    shape: tuple[int, ...],
    chunks: Sequence[Mapping[str, Any]],
    holder_of_file: Callable[[str], int],
    single: dict[int, Runs],
) -> TensorLayout | None:
    """A tensor stored as one chunk covering all of it (no empty dimension), or None."""
    if len(chunks) != 1 or not math.prod(shape):
        return None
    chunk = chunks[0]
    if any(chunk["offsets"]) or tuple(chunk["sizes"]) != shape:
        return None
    return whole_tensor(dtype, shape, holder_of_file(chunk["file"]), single)


def _grid(
    dtype: str, shape: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...], int]]
) -> TensorLayout | None:
    """The grid form of these (non-empty) chunks, or None when they form no grid."""
    if not math.prod(shape):
        return TensorLayout(dtype, shape, holders=Runs.of([])) if not chunks else None
    bounds = []
    for dim, extent in enumerate(shape):
        cuts = sorted({o[dim] for o, _s, _h in chunks} | {o[dim] + s[dim] for o, s, _h in chunks})
        if cuts[0] != 0 or cuts[-1] != extent:
            return None
        bounds.append(cuts)
    split_dims = [dim for dim, cuts in enumerate(bounds) if len(cuts) > 2]
    cells = math.prod(len(bounds[dim]) - 1 for dim in split_dims)
    if cells != len(chunks):
        return None
    holder_at: dict[int, int] = {}
    for offsets, sizes, holder in chunks:
        position = 0
        for dim in range(len(shape)):
            cuts = bounds[dim]
            part = bisect.bisect_left(cuts, offsets[dim])
            if cuts[part] != offsets[dim] or cuts[part + 1] != offsets[dim] + sizes[dim]:
                return None  # spans several parts
            if dim in split_dims:
                position = position * (len(cuts) - 1) + part
        if position in holder_at:
            return None
        holder_at[position] = holder
    holders: list[list[int]] = []
    for position in range(cells):
        holder = holder_at[position]
        if holders and holders[-1][0] + holders[-1][1] == holder:
            holders[-1][1] += 1
        else:
            holders.append([holder, 1])
    split = tuple((dim, Runs.of(_run_lengths(bounds[dim]))) for dim in split_dims)
    return TensorLayout(dtype, shape, split, Runs.of([(h, c) for h, c in holders]))


def _run_lengths(cuts: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[list[int]] = []
    for low, high in itertools.pairwise(cuts):
        if runs and runs[-1][0] == high - low:
            runs[-1][1] += 1
        else:
            runs.append([high - low, 1])
    return [(size, count) for size, count in runs]


# -- parsing (every reader) ------------------------------------------------------------


def parse_tensor_table(raw: Any, holders: Sequence[int], where: str) -> TensorTable:
    """Type-check and bound the root's ``tensors`` section; ``holders`` are the index
    ordinals the root lists (sorted). The explicit form's tiling is checked by the
    restore checks (:mod:`ckptvault.trust.indexes`)."""
    where = f"{where}: tensors"
    if not isinstance(raw, dict):
        raise FormatError(f"{where} must be an object")
    budget = MAX_CELLS
    table = {}
    single: dict[int, Runs] = {}  # holder -> [[holder, 1]]: one Runs for every whole tensor
    for fqn, info in raw.items():
        layout = _whole_layout(info, holders, single)
        if layout is None:
            layout = _parse_layout(info, holders, f"{where}: tensor {fqn[:200]!r}")
        budget -= max(1, layout.cell_count)
        if budget < 0:
            raise FormatError(f"{where}: more than {MAX_CELLS} chunks in all")
        table[fqn] = layout
    return TensorTable(table)


def _whole_layout(
    info: Any, holders: Sequence[int], single: dict[int, Runs]
) -> TensorLayout | None:
    """The layout of a tensor stored whole in one index (every tensor of a one-process
    save: ``{"dtype", "holders": [[k, 1]], "shape"}`` with no empty dimension), checked
    as :func:`_parse_layout` checks it; None for anything else, which that parses (and
    refuses with its messages). A fast path: a root of 100,000 tensors has that many."""
    if type(info) is not dict or len(info) != 3:
        return None
    dtype, shape, held = info.get("dtype"), info.get("shape"), info.get("holders")
    if type(held) is not list or len(held) != 1 or type(shape) is not list:
        return None
    pair = held[0]
    if type(pair) is not list or len(pair) != 2 or [type(x) for x in pair] != [int, int]:
        return None
    if pair[1] != 1:
        return None
    if type(dtype) is not str or dtype not in DTYPES or len(shape) > MAX_TENSOR_RANK:
        return None
    bound, span = MAX_TENSOR_BYTES // element_size(dtype), 1
    for dim in shape:
        if type(dim) is not int or dim < 1:
            return None
        span *= dim
    holder = pair[0]
    if span > bound:
        return None
    runs = single.get(holder)
    if runs is None:
        if _held(holders, holder, 1) != 1:
            return None
        runs = single[holder] = Runs.of([(holder, 1)])
    return TensorLayout(dtype, tuple(shape), (), runs)


def _parse_layout(info: Any, holders: Sequence[int], at: str) -> TensorLayout:
    if not isinstance(info, dict):
        raise FormatError(f"{at}: must be an object")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise FormatError(f"{at}: dtype {str(dtype)[:40]!r} is not one ckptvault writes")
    shape = tuple(checked_shape(info.get("shape"), dtype, at))
    keys = set(info) - {"dtype", "shape"}
    if keys == {"chunks"}:
        return TensorLayout(dtype, shape, chunks=_parse_chunks(info["chunks"], shape, holders, at))
    if keys not in ({"holders"}, {"holders", "split"}):
        raise FormatError(f"{at}: needs holders (and split), or chunks; got {sorted(keys)[:8]}")
    if info.get("split", True) == []:
        raise FormatError(f"{at}: an unsplit tensor has no split key (canonical form)")
    split = _parse_split(info.get("split", []), shape, at)
    cells = math.prod(parts.length for _d, parts in split) if math.prod(shape) else 0
    pairs = _pairs(info["holders"], at, "holders", low=0)
    for first, count in pairs:
        if _held(holders, first, count) != count:
            raise FormatError(f"{at}: holders name an index the root does not list")
    runs = Runs.of(pairs)
    if runs.length != cells:
        raise FormatError(f"{at}: holders cover {runs.length} chunks of a grid of {cells}")
    return TensorLayout(dtype, shape, split, runs)


def _held(holders: Sequence[int], first: int, count: int) -> int:
    """How many of ``first .. first+count-1`` are listed index ordinals."""
    return bisect.bisect_left(holders, first + count) - bisect.bisect_left(holders, first)


def _parse_split(raw: Any, shape: tuple[int, ...], at: str) -> tuple[tuple[int, Runs], ...]:
    if not isinstance(raw, list) or len(raw) > len(shape):
        raise FormatError(f"{at}: split must be a list of at most one entry per dimension")
    split, previous = [], -1
    for entry in raw:
        if not (isinstance(entry, list) and len(entry) == 2 and type(entry[0]) is int):
            raise FormatError(f"{at}: a split entry must be [dim, [[size, count], ...]]")
        dim = entry[0]
        if not previous < dim < len(shape):
            raise FormatError(f"{at}: split dimensions must be ascending dimensions of the shape")
        previous = dim
        parts = Runs.of(_pairs(entry[1], at, "split", low=1))
        if sum(size * count for size, count in parts.pairs) != shape[dim]:
            raise FormatError(f"{at}: the parts of dimension {dim} do not add up to its extent")
        split.append((dim, parts))
    return tuple(split)


def _pairs(raw: Any, at: str, what: str, low: int) -> list[tuple[int, int]]:
    if not isinstance(raw, list) or len(raw) > MAX_CELLS:
        raise FormatError(f"{at}: {what} must be a list of [value, count] pairs")
    pairs = []
    for pair in raw:
        if not (
            isinstance(pair, list)
            and len(pair) == 2
            and all(type(x) is int for x in pair)
            and low <= pair[0] <= MAX_TENSOR_BYTES
            and 1 <= pair[1] <= MAX_CELLS
        ):
            raise FormatError(f"{at}: {what} must be a list of [value, count] pairs of integers")
        pairs.append((pair[0], pair[1]))
    return pairs


def _parse_chunks(
    raw: Any, shape: tuple[int, ...], holders: Sequence[int], at: str
) -> tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]:
    if not isinstance(raw, list) or len(raw) > MAX_CELLS:
        raise FormatError(f"{at}: chunks must be a list")
    chunks = []
    for chunk in raw:
        ok = isinstance(chunk, list) and len(chunk) == 3 and type(chunk[2]) is int
        if ok:
            offsets, sizes, holder = chunk
            ok = _is_index(offsets, shape) and _is_index(sizes, shape)
        if not ok:
            raise FormatError(f"{at}: a chunk must be [offsets, sizes, holder] of integers")
        if _held(holders, holder, 1) != 1:
            raise FormatError(f"{at}: a chunk names an index the root does not list")
        if not math.prod(sizes):
            raise FormatError(f"{at}: a listed chunk holds no element")
        chunks.append((tuple(offsets), tuple(sizes), holder))
    return tuple(chunks)


def _is_index(value: Any, shape: tuple[int, ...]) -> bool:
    return (
        isinstance(value, list)
        and len(value) == len(shape) <= MAX_TENSOR_RANK
        and all(type(x) is int and 0 <= x <= MAX_TENSOR_BYTES for x in value)
    )
