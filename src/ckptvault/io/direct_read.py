"""The zero-copy read of an unencrypted file: ``preadv`` into the destinations.

Where the store hands out a real file descriptor (POSIX) and ``os.preadv`` exists,
each chunk of a plain tensor file is read with one ``preadv`` straight into the
destination tensors it covers (gaps into a bounce buffer), hashed from there, and
compared with its chunk digest before the next chunk is read — so, as on the
streamed path, no byte is used before its chunk verified. Destinations are the
restore's private tensors, never the caller's objects.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable
from typing import Any

import torch

from ckptvault.errors import IntegrityError
from ckptvault.io.read_targets import FilePlan, Scatter, Target
from ckptvault.trust.digests import ChunkVerifier

MAX_PIECES = 512  # iovecs in one preadv; a chunk with more is read plainly, then copied


def descriptor(stream: Any) -> int | None:
    """The stream's OS file descriptor; None for streams without one (an object
    store's), whose ``fileno`` raises ``io.UnsupportedOperation``."""
    try:
        return int(stream.fileno())
    except (AttributeError, OSError, ValueError):  # UnsupportedOperation is both
        return None


def read_plain_direct(
    fd: int,
    name: str,
    size: int,
    chunk_size: int,
    file_plan: FilePlan,
    verifier: ChunkVerifier,
    on_bytes: Callable[[int], None] | None,
) -> None:
    """Zero-copy read of an unencrypted file: each chunk is read with one ``preadv``
    straight into the destination tensors it covers (gaps into a bounce buffer),
    hashed from there, and compared before the next chunk is read."""
    direct = sorted((t for t in file_plan.targets if t.direct), key=lambda t: t.start)
    bounce = torch.empty(chunk_size, dtype=torch.uint8)
    bounce_view = bounce.numpy().data
    to_copy = Scatter([t for t in file_plan.targets if not t.direct])
    direct_fallback = Scatter(direct)  # for chunks with too many pieces for one preadv
    first = 0  # the first direct target that may still overlap a chunk
    _advise(fd, 0, 0, "POSIX_FADV_SEQUENTIAL")
    for lo in range(0, size, chunk_size):
        hi = min(lo + chunk_size, size)
        # Ask the kernel to fetch the next chunks while this one is hashed.
        _advise(fd, hi, 2 * chunk_size, "POSIX_FADV_WILLNEED")
        while first < len(direct) and direct[first].end <= lo:
            first += 1
        # Too many iovecs for one preadv (many small tensors): one plain read, then copy.
        fallback = 2 * _overlapping(direct, first, hi) + 1 > MAX_PIECES
        if fallback:
            pieces = [bounce_view[: hi - lo]]
        else:
            pieces = _chunk_pieces(direct, first, lo, hi, bounce_view)
        count = _preadv_full(fd, pieces, lo)
        if count != hi - lo:
            raise IntegrityError(
                f"{name}: file ends at byte {lo + count}, the manifest records {size}"
            )
        for piece in pieces:
            verifier.update(piece)  # raises before any byte of the chunk is used
        if fallback:
            direct_fallback.put(lo, bounce[: hi - lo])
        to_copy.put(lo, bounce[: hi - lo])
        if on_bytes is not None:
            on_bytes(hi - lo)
    if os.pread(fd, 1, size):
        raise IntegrityError(f"{name}: file is longer than the {size} bytes recorded")
    verifier.finish()
    for target in file_plan.targets:
        target.finish()


def _chunk_pieces(
    direct: list[Target], first: int, lo: int, hi: int, bounce_view: memoryview
) -> list[memoryview]:
    """The buffers bytes ``lo:hi`` of the file are read into, in order: the direct
    targets' own memory where they cover the chunk, the bounce buffer in between."""
    # Direct targets never overlap one another: walk them, filling gaps from bounce.
    pieces: list[memoryview] = []
    position = lo
    index = first
    while index < len(direct) and direct[index].start < hi:
        target = direct[index]
        index += 1
        if target.start > position:
            pieces.append(bounce_view[position - lo : target.start - lo])
            position = target.start
        upto = min(target.end, hi)
        if upto > position:
            region = target.buffer[position - target.start : upto - target.start]
            pieces.append(region.numpy().data)
            position = upto
    if position < hi:
        pieces.append(bounce_view[position - lo : hi - lo])
    return pieces


def _overlapping(direct: list[Target], first: int, hi: int) -> int:
    """How many direct targets from ``first`` on start before ``hi``: the chunk's
    pieces are at most one per target, one per gap before it, and one after."""
    return bisect.bisect_left(direct, hi, lo=first, key=lambda t: t.start) - first


def _advise(fd: int, offset: int, length: int, advice: str) -> None:
    if hasattr(os, "posix_fadvise") and hasattr(os, advice):
        os.posix_fadvise(fd, offset, length, getattr(os, advice))


def _preadv_full(fd: int, pieces: list[memoryview], offset: int) -> int:
    """``preadv`` until every piece is full or the file ends; returns bytes read."""
    total = sum(len(p) for p in pieces)
    done = 0
    while done < total:
        count = os.preadv(fd, pieces, offset + done)
        if count == 0:
            break
        done += count
        if done < total:  # a short read: continue from where it stopped
            remaining, skip = [], count
            for piece in pieces:
                if skip >= len(piece):
                    skip -= len(piece)
                    continue
                remaining.append(piece[skip:])
                skip = 0
            pieces = remaining
    return done
