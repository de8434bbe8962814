"""Tied weights in an export: every name gets its tensor.

A tensor met twice while saving (a tied embedding and LM head) is written once and
the state tree refers to it from both places (:mod:`ckptvault.state.capture`). The
generation's tensor list then names only the first; an export walks the entry's
tree to find the other names, and writes the tensor under each of them (a tensor
file has no aliases), as ``state_dict()`` would list them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ckptvault.state.capture import StatefulPayload, decode_tree
from ckptvault.state.codec import KeyPath
from ckptvault.state.codec_names import tensor_key


class _Markers(Mapping[str, torch.Tensor]):
    """Stands in for a generation's tensors while decoding a tree: one distinct empty
    tensor per key, so that where each reference lands can be told afterwards."""

    def __init__(self, keys: Mapping[str, Any]) -> None:
        self._keys = keys
        self._made: dict[str, torch.Tensor] = {}
        self.key_of: dict[int, str] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self._keys:
            raise KeyError(key)
        if key not in self._made:
            marker = torch.empty(0)
            self._made[key], self.key_of[id(marker)] = marker, key
        return self._made[key]

    def __iter__(self) -> Any:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def tensor_aliases(
    tree: Mapping[str, Any], entry: str, keys: Mapping[str, Any], where: str
) -> dict[str, str]:
    """Names under entry ``entry`` that refer to a tensor stored under another key:
    ``{"lm_head.weight": "model/transformer.wte.weight"}``. ``keys``: the
    generation's tensor keys; ``tree``: its (already checked) state tree."""
    markers = _Markers(keys)
    decoded = decode_tree({entry: tree[entry]}, markers, where)
    aliases: dict[str, str] = {}

    def walk(value: Any, path: KeyPath) -> None:
        if isinstance(value, StatefulPayload):
            walk(value.state, path)
        elif isinstance(value, Mapping):
            for name, item in value.items():
                walk(item, (*path, name))
        elif isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                walk(item, (*path, index))
        elif isinstance(value, torch.Tensor):
            key = markers.key_of.get(id(value))
            if key is not None and key != tensor_key(path):
                aliases[".".join(str(part) for part in path[1:])] = key

    walk(decoded[entry], (entry,))
    return aliases
