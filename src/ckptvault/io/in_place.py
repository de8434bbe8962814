"""Restore into the live tensors themselves (``restore(..., in_place=True)``).

A plain restore reads every tensor into a private buffer, verifying every byte, and
only then copies the buffers into the live tensors: nothing changes unless the whole
generation verified, at the price of a second copy of the state in memory. Read in
one pass straight into the live tensors, a chunk failing its digest half-way would
leave them half overwritten. So an in-place restore reads twice:

1. :func:`verify_first` checks every file of the candidate against its chunk digests,
   streaming it through buffers of at most :data:`BUFFER_BUDGET` bytes in all, and
   keeps only the tensors smaller than :data:`SMALL` (RNG states, step counters:
   what matching the state may look at). A candidate that fails is rejected like any
   other, and restore falls back to the next with nothing changed. The big tensors
   stand in the decoded state as shaped placeholders while the restore plan is made
   and every check on it passes (contract, keys, shapes), still changing nothing.
2. :func:`read_in_place` then reads every big tensor into where the plan puts it: the
   live tensor itself (:meth:`PendingInPlace.destinations`: a plain, contiguous CPU
   tensor of the saved dtype and shape, written by exactly this saved tensor and
   sharing memory with no other), or else a private buffer, as a plain restore
   would. Every chunk is checked against its digest again, in a bounce buffer before
   a byte of it reaches a live tensor (DESIGN rule 2: nothing unverified reaches
   torch). Everything else (modules' other entries, optimizers' state, plain values,
   RNG) is applied afterwards, by the same plan.

A chunk that fails in pass 2 verified in pass 1: its file changed during the restore.
The live tensors then hold verified bytes of this generation up to that point and
their old values after it: :func:`read_in_place` raises :class:`IntegrityError`
saying so, and the state must be restored again. Only generations whose tensors are
each stored whole (what a one-process save writes) are read in place; any other
layout is restored through private buffers, as without ``in_place``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ckptvault.errors import CheckpointError, IntegrityError
from ckptvault.format.layout import is_tensor_file_name
from ckptvault.format.manifest import Manifest
from ckptvault.io.read_targets import FilePlan, Target
from ckptvault.io.reader import VaultStorageReader
from ckptvault.io.whole_read import cannot_allocate, whole_tensor_layout
from ckptvault.state.restore_plan import unwritable
from ckptvault.storage.base import GenerationRef, Store

SMALL = 64 * 1024  # tensors below this are kept in pass 1: matching may read them
BUFFER_BUDGET = 64 * 1024 * 1024  # what the reads of one pass buffer, at most
_LIVE_TYPES = (torch.Tensor, torch.nn.Parameter)

# (fqn, dtype, shape, file, start, length) of one tensor stored whole
_Whole = tuple[str, torch.dtype, list[int], str, int, int]


@dataclass(frozen=True)
class Destinations:
    """Where pass 2 reads each big tensor, and which of them are live tensors."""

    tensors: dict[str, torch.Tensor]
    live: frozenset[str]


@dataclass
class PendingInPlace:
    """A generation past pass 1: what pass 2 reads, and the tensors that stand in
    the decoded state until then (:meth:`tensors`)."""

    store: Store
    ref: GenerationRef
    manifest: Manifest
    threads: int
    data_keys: dict[str, bytes]
    big: list[_Whole]
    small: dict[str, torch.Tensor]
    placeholders: dict[str, torch.Tensor]
    tree: Any = None  # the saved state's tree, to decode again with the tensors read

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the generation: the small ones read, the big ones shaped
        placeholders (one element, expanded: no memory, values meaningless)."""
        return {**self.small, **self.placeholders}

    def destinations(self, targets: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Destinations:
        """Where pass 2 reads each big tensor: the live tensor the restore plan puts
        it in (``targets``: (saved, live) pairs), when that live tensor takes its
        bytes as they are stored and no other tensor shares its memory; a fresh
        private buffer otherwise."""
        fqn_of = {id(tensor): fqn for fqn, tensor in self.placeholders.items()}
        found: dict[str, list[torch.Tensor]] = {}
        for saved, live in targets:
            fqn = fqn_of.get(id(saved))
            if fqn is not None:
                found.setdefault(fqn, []).append(live)
        chosen = {}
        for fqn, dtype, shape, *_rest in self.big:
            lives = found.get(fqn, [])
            if len(lives) == 1 and _takes_bytes(lives[0], dtype, shape):
                chosen[fqn] = lives[0]
        chosen = _without_overlaps(chosen)
        where = f"generation {self.ref.generation_id}"
        tensors = {}
        try:
            for fqn, dtype, shape, *_rest in self.big:
                found_live = chosen.get(fqn)
                tensors[fqn] = (
                    found_live if found_live is not None else torch.empty(shape, dtype=dtype)
                )
        except (RuntimeError, MemoryError) as exc:
            raise cannot_allocate(where, sum(e[5] for e in self.big), exc) from exc
        return Destinations(tensors, frozenset(chosen))


def verify_first(
    store: Store,
    ref: GenerationRef,
    manifest: Manifest,
    threads: int,
    data_keys: dict[str, bytes],
) -> PendingInPlace | None:
    """Pass 1: every tensor file of ``ref`` verified with bounded buffers, its small
    tensors read; None when its tensors are not each stored whole (restore it through
    private buffers). Raises what the reader raises for bytes that do not verify."""
    where = f"generation {ref.generation_id}"
    layout = whole_tensor_layout(manifest, where)
    if layout is None:
        return None
    plans = {name: FilePlan() for name in manifest.files if is_tensor_file_name(name)}
    small: dict[str, torch.Tensor] = {}
    big: list[_Whole] = []
    try:
        for entry in layout:
            fqn, dtype, shape, file, start, length = entry
            if file not in plans:
                raise OSError(f"{where}: tensor {fqn[:200]!r} lives in unknown file {file}")
            if length >= SMALL:
                big.append(entry)
                continue
            tensor = small[fqn] = torch.empty(shape, dtype=dtype)
            flat = tensor.reshape(-1).view(torch.uint8)
            plans[file].targets.append(Target(start, start + length, flat, direct=True))
    except (RuntimeError, MemoryError) as exc:
        raise cannot_allocate(where, sum(e[5] for e in layout), exc) from exc
    _reader(store, ref, manifest, threads, data_keys).read_files(plans)
    placeholders = {
        fqn: torch.empty(1, dtype=dtype).expand(shape) for fqn, dtype, shape, *_rest in big
    }
    return PendingInPlace(store, ref, manifest, threads, data_keys, big, small, placeholders)


def read_in_place(pending: PendingInPlace, destinations: Destinations) -> None:
    """Pass 2: every big tensor into its destination (a live tensor or a private
    buffer), each chunk verified again before it is used. A chunk that no longer
    verifies raises :class:`IntegrityError` saying what that means for the state."""
    manifest, ref = pending.manifest, pending.ref
    plans = {name: FilePlan() for name in manifest.files if is_tensor_file_name(name)}
    for fqn, _dtype, _shape, file, start, length in pending.big:
        flat = destinations.tensors[fqn].reshape(-1).view(torch.uint8)
        # A live tensor gets each chunk only once it verified (copied from the bounce
        # buffer); a private one may take it straight from the file (preadv).
        direct = fqn not in destinations.live
        plans[file].targets.append(Target(start, start + length, flat, direct=direct))
    try:
        _reader(pending.store, ref, manifest, pending.threads, pending.data_keys).read_files(plans)
    except (CheckpointError, OSError) as exc:
        raise _changed(ref, exc, len(destinations.live)) from exc


def _changed(ref: GenerationRef, exc: BaseException, live: int) -> IntegrityError:
    if not live:
        return IntegrityError(
            f"generation {ref.generation_id} changed while it was restored, after it "
            f"verified ({exc}); no live tensor had been written and nothing was applied: "
            "restore again"
        )
    return IntegrityError(
        f"generation {ref.generation_id} changed while it was restored in place, after it "
        f"verified ({exc}). Live tensors (up to {live} of them) were partly overwritten "
        "with verified bytes of this generation and hold their old values elsewhere; "
        "nothing else was applied. The state is inconsistent: restore it again (without "
        "in_place=True, a restore that fails leaves the state untouched)"
    )


def _reader(
    store: Store, ref: GenerationRef, manifest: Manifest, threads: int, keys: dict[str, bytes]
) -> VaultStorageReader:
    """A reader whose threads together buffer at most :data:`BUFFER_BUDGET`: each
    holds a chunk-sized bounce buffer (and, decrypting, a segment)."""
    bounded = max(1, min(threads, BUFFER_BUDGET // (2 * manifest.chunk_size)))
    empty = Metadata(state_dict_metadata={})
    return VaultStorageReader(store, ref, manifest, empty, {}, bounded, None, keys)


def _takes_bytes(live: torch.Tensor, dtype: torch.dtype, shape: list[int]) -> bool:
    """Whether ``live``'s own memory can take a stored tensor of ``dtype`` and
    ``shape`` byte for byte: a plain, dense, contiguous CPU tensor of both."""
    return (
        type(live) in _LIVE_TYPES
        and live.device.type == "cpu"
        and live.layout == torch.strided
        and live.dtype == dtype
        and list(live.shape) == list(shape)
        and live.is_contiguous()
        and not live.is_conj()
        and not live.is_neg()
        and live.numel() > 0
        and unwritable(live) is None
    )


def _without_overlaps(chosen: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``chosen`` less every tensor whose memory overlaps another's (tied weights,
    views of one buffer): which value would win is not for the reader to decide."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), fqn)
        for fqn, t in chosen.items()
    )
    clash: set[str] = set()
    reach, holder = -1, ""  # the furthest end so far, and whose it is
    for lo, hi, fqn in spans:
        if lo < reach:
            clash.update((fqn, holder))
        if hi > reach:
            reach, holder = hi, fqn
    return {fqn: t for fqn, t in chosen.items() if fqn not in clash}
