"""The planner-free read: every tensor stored whole, read straight into its buffer.

A single-process restore loads a generation into buffers it allocates from the
manifest itself, so when every tensor is stored as exactly one chunk that covers it
whole (what a single-process save always writes, and a multi-rank save for every
tensor it did not shard), DCP's load planning has nothing to decide: each chunk's
bytes go, unchanged, into one fresh tensor of the chunk's dtype and shape. Building
DCP's metadata objects, read items and plans for that costs tens of microseconds per
tensor, more than reading a small tensor; this module skips them and hands the
reader the same :class:`~ckptvault.io.read_targets.Target` s it would have built.

Nothing about verification changes: the reader still streams every tensor file
whole and checks every chunk against its digest before any byte is used, exactly as
on DCP's path. Any other layout (a tensor split into shards, a chunk at an offset)
returns None and the caller goes through DCP, which reshards.
"""

from __future__ import annotations

import errno
import math

import torch

from ckptvault.errors import FormatError
from ckptvault.format.layout import is_tensor_file_name
from ckptvault.format.manifest import Manifest
from ckptvault.io.dcp_metadata import dtype_from_name
from ckptvault.io.read_targets import FilePlan, Target

# (fqn, dtype, shape, file, start, length) of one tensor stored as one whole chunk
_Whole = tuple[str, torch.dtype, list[int], str, int, int]


def whole_tensor_layout(manifest: Manifest, where: str) -> list[_Whole] | None:
    """Each tensor's one whole chunk, or None when some tensor is stored otherwise
    (then DCP's planner maps the chunks onto the tensors).

    The manifest has passed the restore checks (types, tiling, chunks inside their
    files); what this path relies on is checked again here, cheaply, so that a
    caller that skipped them gets a :class:`FormatError`, never a wrong read.
    """
    dtypes: dict[str, torch.dtype] = {}
    layout: list[_Whole] = []
    for fqn, info in manifest.dcp["tensors"].items():
        chunks = info["chunks"]
        if len(chunks) != 1:
            return None
        (chunk,) = chunks
        shape, offsets = info["shape"], chunk["offsets"]
        if chunk["sizes"] != shape or len(offsets) != len(shape) or any(offsets):
            return None
        name = info["dtype"]
        dtype = dtypes.get(name)
        if dtype is None:
            dtype = dtypes[name] = dtype_from_name(name, where)
        length = chunk["length"]
        if length != math.prod(shape) * dtype.itemsize:
            raise FormatError(
                f"{where}: tensor {fqn[:200]!r} records {length} bytes, not the "
                f"{math.prod(shape) * dtype.itemsize} its shape {shape} of {name} takes"
            )
        layout.append((fqn, dtype, shape, chunk["file"], chunk["start"], length))
    return layout


def plan_whole_tensors(
    manifest: Manifest, layout: list[_Whole], where: str
) -> tuple[dict[str, torch.Tensor], dict[str, FilePlan]]:
    """Fresh tensors for ``layout`` and, for every tensor file of the generation (each
    is read, and so verified, even when no tensor lives in it), the targets its
    verified bytes land in: the tensors' own memory."""
    needed = sum(entry[5] for entry in layout)
    if needed > manifest.total_bytes:  # never allocate more than the files hold
        raise FormatError(
            f"{where}: the manifest's tensors take {needed} bytes, more than the "
            f"{manifest.total_bytes} its files hold"
        )
    plans = {name: FilePlan() for name in manifest.files if is_tensor_file_name(name)}
    destinations: dict[str, torch.Tensor] = {}
    try:
        for fqn, dtype, shape, file, start, length in layout:
            plan = plans.get(file)
            if plan is None:
                raise FormatError(f"{where}: tensor {fqn[:200]!r} lives in unknown file {file}")
            tensor = torch.empty(shape, dtype=dtype)
            destinations[fqn] = tensor
            # Its bytes, flat (a 1-D tensor's bytes view is flat already: one call less
            # for the many small vectors, biases and norms, of a large state).
            flat = (tensor if len(shape) == 1 else tensor.view(-1)).view(torch.uint8)
            plan.targets.append(Target(start, start + length, flat, direct=True))
    except (RuntimeError, MemoryError) as exc:  # the allocator's own error, untyped
        raise cannot_allocate(where, needed, exc) from exc
    return destinations, plans


def cannot_allocate(where: str, needed: int, exc: BaseException) -> OSError:
    """The error for an allocator that cannot serve a generation's tensors: an
    OSError, so that the loader skips the generation as unreadable here."""
    return OSError(
        errno.ENOMEM,
        f"{where}: cannot allocate the {needed} bytes its tensors take "
        f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]}); restore it on a "
        "machine with more memory, or check that the generation is genuine",
    )
