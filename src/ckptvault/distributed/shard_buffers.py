"""The private buffers a rank of many restores into, and what it reads for them.

A rank restores its live tensors' shards (a DTensor's local box; a plain tensor
whole) into fresh buffers of the same layout, never into the live tensors: nothing
changes before every rank's verdict. A fresh optimizer has no state yet, so its
state is read into buffers shaped like the parameter it belongs to
(:func:`optimizer_param_hints`).
"""

from __future__ import annotations

from typing import Any

import torch

from ckptvault.errors import FormatError
from ckptvault.format.manifest import Manifest
from ckptvault.format.tensor_table import Box
from ckptvault.io.dcp_metadata import tensor_metadata
from ckptvault.state.codec import tensor_key
from ckptvault.state.param_names import parameter_names


def optimizer_param_hints(state: Any) -> dict[str, torch.Tensor]:
    """For each optimizer among the top-level entries (and one level of dicts) of a
    live state: its parameters by the key prefixes their state may be saved under
    (its position, and its name: :mod:`ckptvault.state.param_names`)."""
    hints: dict[str, torch.Tensor] = {}
    entries: list[tuple[tuple[str, ...], Any]] = [((key,), value) for key, value in state.items()]
    entries += [
        ((key, inner), nested)
        for key, value in state.items()
        if isinstance(value, dict)
        for inner, nested in value.items()
        if isinstance(inner, str)
    ]
    names = parameter_names(state)  # state saved by parameter name, or by position
    for path, value in entries:
        if isinstance(value, torch.optim.Optimizer):
            params = [p for group in value.param_groups for p in group["params"]]
            for index, param in enumerate(params):
                hints[tensor_key((*path, "state", index)) + "/"] = param
                if id(param) in names:
                    hints[tensor_key((*path, "state", names[id(param)])) + "/"] = param
    return hints


def hinted(keys: set[str], hints: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Live stand-ins for optimizer state a fresh optimizer lacks: its parameter,
    so that a sharded parameter's state is read as a shard of the same layout."""
    found = {}
    for key in keys:
        prefix, _sep, _name = key.rpartition("/")
        param = hints.get(prefix + "/")
        if param is not None:
            found[key] = param.detach()
    return found


def regions(
    keys: set[str], live: dict[str, torch.Tensor], manifest: Manifest
) -> dict[str, list[Box] | None]:
    """The part of each referenced tensor this rank reads: a live tensor of the saved
    shape, its own chunks (a DTensor's local shard; a plain tensor whole); any other,
    all of the saved one (None)."""
    assert manifest.tensor_table is not None
    table = manifest.tensor_table.tensors
    regions: dict[str, list[Box] | None] = {}
    for key in keys:
        current, saved = live.get(key), table.get(key)
        if current is None or saved is None or tuple(current.shape) != saved.shape:
            regions[key] = None
            continue
        chunk_list = getattr(current, "__create_chunk_list__", None)
        if chunk_list is None:
            regions[key] = [((0,) * current.dim(), tuple(current.shape))]
        else:
            regions[key] = [(tuple(c.offsets), tuple(c.sizes)) for c in chunk_list()]
    return regions


def shard_buffers(
    metadata: Any,
    keys: set[str],
    live: dict[str, torch.Tensor],
    manifest: Manifest,
    where: str,
) -> dict[str, torch.Tensor]:
    """A private buffer per referenced tensor: shaped like the live tensor (a DTensor:
    its local shard) when the saved one matches it, else the saved tensor whole."""
    destinations: dict[str, torch.Tensor] = {}
    whole = 0
    for key in sorted(keys):
        if key not in metadata.state_dict_metadata:
            raise FormatError(f"{where}: the state refers to tensor {key!r}, which it lacks")
        info = tensor_metadata(metadata, key)
        current = live.get(key)
        if current is not None and tuple(current.shape) == tuple(info.size):
            destinations[key] = torch.empty_like(current, dtype=info.properties.dtype)
            continue
        whole += torch.Size(info.size).numel() * info.properties.dtype.itemsize
        if whole > manifest.total_bytes:  # what the files hold bounds what they can fill
            raise FormatError(f"{where}: its tensors take more bytes than its files hold")
        destinations[key] = torch.empty(tuple(info.size), dtype=info.properties.dtype)
    return destinations
