"""Read each shared byte once: one rank of those that need a digest chunk reads it,
the others receive it from that rank.

In a DDP or HSDP restore several ranks need the same stored bytes (a replicated
tensor; the shard every replica group holds). Each rank's load plan says which byte
ranges of which files it reads (:meth:`~ckptvault.io.ranged_reader.RangedStorageReader.byte_ranges`);
they are rounded out to digest chunks ("blocks": the unit every byte is verified in)
and all-gathered as bounded JSON. Every rank computes the same :func:`schedule` from
the same messages: each block two or more ranks need gets one owner among them (the
shared blocks of a file are cut into one contiguous run per rank that needs them,
the least loaded rank taking the first), which reads it from the store and sends it,
as raw bytes point to point over the coordinator's gloo group, to the others that
need it. Blocks one rank alone needs it reads itself, as before.

Trust: a receiver checks every block it receives against the chunk digest of the
manifest it verified itself (the signed root, the index covering the file), in the
same place and the same way as a block it reads from the store
(:class:`~ckptvault.io.verified_ranges.VerifiedRanges`). Trusting the owner's verdict
instead would let one broken or dishonest rank make the others apply bytes the
manifest does not vouch for; the check costs one BLAKE3 pass over bytes this rank
copies anyway (a few GB/s a core; docs/speed.md's read-once table measures it). A block
that does not verify is a digest mismatch of the candidate on the rank that found it,
and the stage's verdict makes every rank reject the candidate together and fall back
together (:mod:`ckptvault.distributed.restore`).

Order: the schedule is one list in (file, block) order, the order in which every
rank's reader asks for blocks. A rank walks it lazily, taking part in the transfers
it sends or receives, up to the block its reader asks for; once its reader is done
(or failed) it walks the rest. Every rank walks the same list in the same order, so
the earliest unfinished transfer always has all its ranks at it: no rank waits on a
partner that waits elsewhere. A rank whose read failed still takes part in every
later transfer: as an owner it sends a block marked as not read (no store read),
which its receivers refuse, so that everyone fails this candidate promptly instead
of waiting for bytes until the group's timeout. A block the exchange did not bring
(never scheduled for this rank, or already passed) is read from the store: the
schedule decides only who reads, never what is trusted.

``CKPTVAULT_READ_ONCE=0`` in the environment of every rank turns the exchange off
(each rank reads everything it needs itself, as before; for comparisons). Any rank
without it, or whose coordinator cannot send tensors, makes every rank read alone.
"""

from __future__ import annotations

import errno
import itertools
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ckptvault.distributed.wire import Field
from ckptvault.errors import CheckpointError
from ckptvault.format.container import SEGMENT_OVERHEAD, ContainerHeader, build_container_header
from ckptvault.format.manifest import Manifest

_OK, _UNREADABLE, _ABORTED = 0, 1, 2  # the status byte after a block's bytes
_MAX_PENDING = 16  # blocks received ahead of the reader asking for them (bounded memory)
_MAX_NAME = 1024


@runtime_checkable
class TensorPeers(Protocol):
    """A coordinator that moves raw tensors between ranks
    (:class:`~ckptvault.distributed.coordinator.TorchDistributed`)."""

    @property
    def rank(self) -> int: ...

    def send_tensor(self, tensor: torch.Tensor, destinations: list[int]) -> None: ...

    def receive_tensor(self, tensor: torch.Tensor, source: int) -> None: ...


def enabled() -> bool:
    """Whether this rank offers to share reads (``CKPTVAULT_READ_ONCE`` is not "0")."""
    return os.environ.get("CKPTVAULT_READ_ONCE", "1") != "0"


# -- what a rank needs -------------------------------------------------------------------


Runs = dict[str, list[tuple[int, int]]]  # file -> sorted, disjoint (first, last) blocks


def needed_blocks(ranges: Sequence[tuple[str, int, int]], manifest: Manifest) -> Runs:
    """The blocks (digest chunks of the stored file) that reading ``ranges`` (file,
    start, end; plaintext offsets of an encrypted file) touches, as runs per file.

    For an encrypted file the container's layout is predicted from the manifest's
    segment size and the file's recorded size; a wrong prediction (a hostile file)
    costs only reads: what the exchange does not bring, the reader reads itself."""
    size = manifest.chunk_size
    encrypted = manifest.encryption
    blocks: dict[str, set[int]] = {}
    containers: dict[str, ContainerHeader | None] = {}
    for name, start, end in ranges:
        record = manifest.files.get(name)
        if record is None or end <= start:
            continue
        wanted = blocks.setdefault(name, set())
        stored: list[tuple[int, int]] = [(start, end)]
        if encrypted is not None and name in encrypted.wrapped_keys:
            if name not in containers:
                containers[name] = _container(record.size, encrypted.segment_size)
            header = containers[name]
            if header is None:
                stored = [(0, 1)]
            else:  # the header, the segment holding the tensor header, the tensor's
                stored = [(0, len(header.header_bytes))]
                stored += _segments(header, 0, 1) + _segments(header, start, end)
        for lo, hi in stored:
            hi = min(hi, record.size)
            if hi > lo:
                wanted.update(range(lo // size, (hi - 1) // size + 1))
    return {name: _runs(sorted(found)) for name, found in sorted(blocks.items()) if found}


def _container(stored_size: int, segment_size: int) -> ContainerHeader | None:
    """The container header of an encrypted file of ``stored_size`` bytes written with
    ``segment_size``: its stored size grows strictly with the plaintext's, so one
    plaintext size fits (None when none does)."""
    if segment_size <= 0:
        return None
    lo, hi = 0, stored_size
    while lo <= hi:
        middle = (lo + hi) // 2
        header = build_container_header(segment_size, middle)
        if header.stored_size == stored_size:
            return header
        lo, hi = (middle + 1, hi) if header.stored_size < stored_size else (lo, middle - 1)
    return None


def _segments(header: ContainerHeader, start: int, end: int) -> list[tuple[int, int]]:
    """Stored byte ranges of the segments holding plaintext bytes ``start..end``."""
    step = header.segment_size
    first, last = start // step, max(start, end - 1) // step
    if first >= header.segments:
        return []
    last = min(last, header.segments - 1)
    offset = len(header.header_bytes)
    sealed = step + SEGMENT_OVERHEAD
    end_of_last = offset + last * sealed + header.segment_plaintext(last) + SEGMENT_OVERHEAD
    return [(offset + first * sealed, end_of_last)]


def _runs(indices: list[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for index in indices:
        if runs and runs[-1][1] == index - 1:
            runs[-1] = (runs[-1][0], index)
        else:
            runs.append((index, index))
    return runs


def encode_needs(needs: Runs | None) -> Any:
    """This rank's message: its runs, or None when it does not share reads."""
    if needs is None:
        return None
    return {name: [list(run) for run in runs] for name, runs in needs.items()}


def decode_needs(raw: Any, rank: int, manifest: Manifest) -> Runs | None:
    """Rank ``rank``'s needs, checked: files the manifest lists, blocks inside them,
    runs sorted and disjoint (so no message names more blocks than the files hold).
    Every rank checks the same messages against the same root, so a refusal
    (:class:`~ckptvault.errors.PeerMessageError`) is raised on every rank alike."""
    if raw is None:
        return None
    field = Field(rank, "the blocks it reads")
    if not isinstance(raw, dict):
        raise field.refuse("not an object of files")
    needs: Runs = {}
    for name, runs in raw.items():
        record = manifest.files.get(name) if len(name) <= _MAX_NAME else None
        if record is None:
            raise field.refuse("a file the manifest does not list")
        blocks = -(-record.size // manifest.chunk_size)
        checked, after = [], 0
        for run in field.sequence(runs, "a file's runs"):
            first, last = field.counts(run, "a run of blocks", 2, max(0, blocks - 1))
            if first < after or last < first:
                raise field.refuse("runs of blocks out of order or overlapping")
            checked.append((first, last))
            after = last + 1
        needs[name] = checked
    return needs


# -- who reads what ----------------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    """Block ``index`` of file ``name`` (``length`` bytes): ``owner`` reads it and
    sends it to ``receivers``."""

    name: str
    index: int
    length: int
    owner: int
    receivers: tuple[int, ...]


def schedule(needs: Sequence[Runs], sizes: dict[str, int], chunk_size: int) -> list[Transfer]:
    """Every block two or more ranks need, in (file, block) order, each with one owner
    among them. A file's shared blocks are cut into contiguous runs, one per rank that
    needs them (sequential reads for each owner); the ranks that have read the fewest
    bytes so far take the first, longer runs. A pure function of its arguments: every
    rank computes the same schedule."""
    load = [0] * len(needs)
    transfers: list[Transfer] = []
    for name in sorted({name for runs in needs for name in runs}):
        for first, last, ranks in _shared_spans(name, needs):
            count = last - first + 1
            # Least loaded first; ties broken by rank, rotated by the span's start.
            order = sorted(ranks, key=lambda r: (load[r], (r - first) % len(load)))
            start = first
            for position, owner in enumerate(order):
                take = count // len(order) + (1 if position < count % len(order) else 0)
                others = tuple(r for r in ranks if r != owner)
                for index in range(start, start + take):
                    length = min(chunk_size, sizes[name] - index * chunk_size)
                    transfers.append(Transfer(name, index, length, owner, others))
                    load[owner] += length
                start += take
    return transfers


def _shared_spans(name: str, needs: Sequence[Runs]) -> list[tuple[int, int, tuple[int, ...]]]:
    """(first, last, ranks) of each span of blocks of ``name`` that the same two or
    more ranks need (a sweep over every rank's runs)."""
    events: dict[int, list[tuple[int, int]]] = {}
    for rank, runs in enumerate(needs):
        for first, last in runs.get(name, ()):
            events.setdefault(first, []).append((rank, 1))
            events.setdefault(last + 1, []).append((rank, -1))
    spans = []
    active: set[int] = set()
    points = sorted(events)
    for point, following in itertools.pairwise(points):
        for rank, change in events[point]:
            if change > 0:
                active.add(rank)
            else:
                active.discard(rank)
        if len(active) >= 2:
            spans.append((point, following - 1, tuple(sorted(active))))
    return spans


# -- the exchange ------------------------------------------------------------------------


class BlockExchange:
    """This rank's part of a :func:`schedule`, walked as its reader asks for blocks
    (a :class:`~ckptvault.io.verified_ranges.BlockSource`); see the module docstring.

    ``read(name, index, length)`` reads a block this rank owns from the store."""

    def __init__(
        self,
        transfers: list[Transfer],
        peers: TensorPeers,
        read: Callable[[str, int, int], bytes],
    ) -> None:
        self.transfers = transfers
        self.peers = peers
        self.rank = peers.rank
        self.read = read
        # Where in the schedule each block this rank sends or receives is.
        self._position = {
            (t.name, t.index): i
            for i, t in enumerate(transfers)
            if t.owner == self.rank or self.rank in t.receivers
        }
        self._next = 0
        self._pending: OrderedDict[tuple[str, int], tuple[Any, str] | BaseException] = OrderedDict()
        self._aborted = False
        self.bytes_read = 0  # from the store, by this rank, for the schedule
        self.bytes_received = 0

    def fetch(self, name: str, index: int, length: int) -> tuple[Any, str] | None:
        """The block, and who sent it ("" for this rank's own read); None when the
        exchange does not bring it to this rank (read it from the store)."""
        key = (name, index)
        position = self._position.get(key)
        if position is None:
            return None
        if key not in self._pending:
            if position < self._next:
                return None  # passed already: asked for again after a later one
            self._walk(position + 1)
        found = self._pending.pop(key, None)
        if isinstance(found, BaseException):
            raise found
        return found

    def finish(self, failed: bool) -> None:
        """Take part in every transfer left; ``failed``: this rank's reader failed, so
        it sends what it owns marked as not read, without reading it."""
        self._aborted = self._aborted or failed
        self._walk(len(self.transfers))
        self._pending.clear()

    def _walk(self, upto: int) -> None:
        while self._next < upto:
            transfer = self.transfers[self._next]
            self._next += 1
            if transfer.owner == self.rank:
                self._send(transfer)
            elif self.rank in transfer.receivers:
                self._receive(transfer)

    def _send(self, transfer: Transfer) -> None:
        buffer = torch.zeros(transfer.length + 1, dtype=torch.uint8)
        status: int = _ABORTED
        kept: tuple[Any, str] | BaseException | None = None
        if not self._aborted:
            try:
                data = self.read(transfer.name, transfer.index, transfer.length)
                self.bytes_read += len(data)
                count = min(len(data), transfer.length)
                buffer.numpy().data[:count] = memoryview(data)[:count]
                status, kept = _OK, (data, "")
            except (CheckpointError, OSError) as exc:
                status, kept = _UNREADABLE, exc
        buffer[transfer.length] = status
        if kept is not None:
            self._keep((transfer.name, transfer.index), kept)
        self.peers.send_tensor(buffer, list(transfer.receivers))

    def _receive(self, transfer: Transfer) -> None:
        buffer = torch.empty(transfer.length + 1, dtype=torch.uint8)
        self.peers.receive_tensor(buffer, transfer.owner)
        self.bytes_received += transfer.length
        if self._aborted:
            return
        status = int(buffer[transfer.length])
        where = f"chunk {transfer.index + 1} of {transfer.name}"
        kept: tuple[Any, str] | BaseException
        if status == _OK:
            kept = (buffer.numpy().data[: transfer.length], f"rank {transfer.owner}")
        elif status == _UNREADABLE:
            kept = OSError(
                errno.EIO,
                f"rank {transfer.owner}, which reads {where} for this rank, could not read "
                "it (its own verdict says why)",
            )
        else:
            kept = OSError(
                errno.EIO,
                f"rank {transfer.owner}, which reads {where} for this rank, stopped reading "
                "after a failure of its own (its verdict says which)",
            )
        self._keep((transfer.name, transfer.index), kept)

    def _keep(self, key: tuple[str, int], value: tuple[Any, str] | BaseException) -> None:
        self._pending[key] = value
        while len(self._pending) > _MAX_PENDING:  # never asked for: read again if it is
            self._pending.popitem(last=False)
