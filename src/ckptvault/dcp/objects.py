"""The non-tensor values of a DCP state dict, stored as JSON, never pickled.

``get_state_dict(model, optimizer)`` hands DCP an optimizer's ``param_groups``
(learning rate, betas, weight decay, the parameters' names, ...) beside its tensors,
and state dicts often hold counters and strings too. DCP's planner makes each such
leaf a ``BYTE_IO`` item, which its own storage would ``torch.save`` and its load
planner ``torch.load``: pickle. The plugin stores them instead with ckptvault's
pickle-free JSON codec (:mod:`ckptvault.state.codec`, the one the manager's state
capture uses):

- save: the rank DCP assigned an item to takes the value itself from its planner
  (``lookup_object``; ``transform_object``, which would pickle it, is never
  called) and encodes it; a value the codec cannot hold (an arbitrary object, a
  set) is refused with a ``UsageError`` naming its key, before anything is
  published. The canonical JSON travels to the coordinator in the item's write
  result, and the coordinator puts every value into the manifest's ``state`` as
  ``{"dcp_objects": {fqn: value, ...}}`` (an encrypted run: into the encrypted
  state file, :mod:`ckptvault.io.state_file`), covered by the manifest's
  self-digest, its signature and its MAC like everything else.
- load: every rank decodes them from its verified manifest (or state file) while
  the generation is chosen (a malformed tree rejects the candidate, as any other
  problem does); DCP's metadata then lists them as byte entries, so DCP plans their
  reads, and the reader sets each value where DCP's default load planner puts what
  it unpickles. A load planner with its own ``load_bytes`` (which takes pickled
  bytes) is refused.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata
from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem, SavePlanner, WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ckptvault.dcp.publish import PLUGIN_NAME
from ckptvault.errors import FormatError, StateMismatchError, UnsupportedValueError, UsageError
from ckptvault.format.canonical import dumps_canonical, loads_canonical
from ckptvault.format.manifest import Manifest
from ckptvault.state.codec import decode_plain, encode_plain

# The key of a plugin generation's state tree that holds its non-tensor values.
OBJECTS_KEY = "dcp_objects"


@dataclass(frozen=True)
class WrittenObject:
    """``WriteResult.storage_data`` of a non-tensor value: the canonical JSON of its
    codec encoding, on its way to the coordinator."""

    data: bytes


# -- save ------------------------------------------------------------------------------


def encode_objects(items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
    """Each ``BYTE_IO`` item's value as JSON, in DCP's write results; ``UsageError``
    naming every value the codec cannot hold (nothing is written then)."""
    if not items:
        return []
    lookup: Callable[[Any], Any] | None = getattr(planner, "lookup_object", None)
    if not callable(lookup):
        raise UsageError(
            f"the save planner {type(planner).__name__} has no lookup_object(): ckptvault "
            "stores a state dict's non-tensor values as JSON from the value itself and "
            "never pickles; save with DCP's DefaultSavePlanner or a subclass of it"
        )
    results: list[WriteResult] = []
    refused: dict[str, str] = {}  # fqn -> why
    for item in items:
        fqn = item.index.fqn
        try:
            data = dumps_canonical(encode_plain(lookup(item.index), (fqn,)))
        except (UnsupportedValueError, FormatError) as exc:
            refused[fqn] = str(exc)
            continue
        results.append(
            WriteResult(index=item.index, size_in_bytes=len(data), storage_data=WrittenObject(data))
        )
    if refused:
        _refuse(refused)
    return results


def _refuse(refused: dict[str, str]) -> NoReturn:
    names = sorted(refused)
    shown = ", ".join(repr(name) for name in names[:8]) + (" ..." if len(names) > 8 else "")
    raise UsageError(
        f"{len(names)} state dict value(s) given to dcp.save cannot be stored ({shown}): "
        "ckptvault stores non-tensor values (an optimizer's param_groups, counters, "
        "strings) as JSON with its pickle-free codec, never pickled as DCP would: "
        f"{refused[names[0]]}. Nothing was published"
    )


def split_results(
    metadata: Metadata, results: list[list[WriteResult]]
) -> tuple[Metadata, list[list[WriteResult]], dict[str, Any]]:
    """The coordinator's view of a finished save: DCP's metadata and every rank's
    write results with the non-tensor values taken out, and those values decoded
    (fqn -> value). ``FormatError`` when they do not match DCP's metadata."""
    values: dict[str, Any] = {}
    tensor_results: list[list[WriteResult]] = []
    for rank_results in results:
        kept = []
        for result in rank_results:
            written = result.storage_data
            if not isinstance(written, WrittenObject):
                kept.append(result)
                continue
            fqn = result.index.fqn
            if fqn in values:
                raise FormatError(f"the value {fqn!r} was written twice")
            where = f"the value {fqn[:200]!r}"
            values[fqn] = decode_plain(loads_canonical(written.data, where), where)
        tensor_results.append(kept)
    entries = metadata.state_dict_metadata
    expected = {fqn for fqn, info in entries.items() if isinstance(info, BytesStorageMetadata)}
    if set(values) != expected:
        missing = sorted(expected - set(values))[:3]
        extra = sorted(set(values) - expected)[:3]
        raise FormatError(
            f"the non-tensor values written do not match DCP's metadata (missing "
            f"{missing}, unexpected {extra})"
        )
    tensors_only = {fqn: info for fqn, info in entries.items() if fqn not in expected}
    return dataclasses.replace(metadata, state_dict_metadata=tensors_only), tensor_results, values


def objects_tree(values: Mapping[str, Any]) -> dict[str, Any]:
    """A plugin generation's state tree: ``{}`` when it holds no non-tensor value."""
    if not values:
        return {}
    return {OBJECTS_KEY: encode_plain(dict(sorted(values.items())), (OBJECTS_KEY,))}


# -- load ------------------------------------------------------------------------------


def stored_objects(manifest: Manifest, tree: Any, where: str) -> dict[str, Any]:
    """The non-tensor values of a generation (fqn -> value), from its verified state
    tree: those a plugin save stored, none for a generation the manager wrote (its
    tree is its own). ``FormatError`` when a plugin generation's tree is malformed."""
    writer = manifest.writer
    if not isinstance(writer, dict) or writer.get("via") != PLUGIN_NAME:
        return {}
    if not isinstance(tree, dict) or not set(tree) <= {OBJECTS_KEY}:
        raise FormatError(
            f"{where}: the state of a DCP plugin generation holds nothing but {OBJECTS_KEY!r}"
        )
    if OBJECTS_KEY not in tree:
        return {}
    values = decode_plain(tree[OBJECTS_KEY], f"{where}: {OBJECTS_KEY}")
    if not isinstance(values, dict) or not all(type(fqn) is str for fqn in values):
        raise FormatError(f"{where}: {OBJECTS_KEY} is not a mapping of state dict keys")
    return values


def with_objects(metadata: Metadata, values: Mapping[str, Any]) -> Metadata:
    """DCP's metadata of a generation, its non-tensor values listed as byte entries
    (so that DCP's load planner plans their reads)."""
    if not values:
        return metadata
    clash = sorted(set(values) & set(metadata.state_dict_metadata))
    if clash:
        raise FormatError(f"{clash[:3]} are stored both as tensors and as values")
    entries = {**metadata.state_dict_metadata, **{fqn: BytesStorageMetadata() for fqn in values}}
    return dataclasses.replace(metadata, state_dict_metadata=entries)


def object_setter(
    items: list[ReadItem], planner: LoadPlanner, values: Mapping[str, Any]
) -> Callable[[], None]:
    """Checks that ``items`` can be loaded without pickle and returns what sets them
    (called once the tensors were read): each value, a copy, goes where DCP's
    default load planner would put what its ``load_bytes`` unpickled."""
    if not items:
        return lambda: None
    if not isinstance(planner, DefaultLoadPlanner) or (
        type(planner).load_bytes is not DefaultLoadPlanner.load_bytes
    ):
        raise UsageError(
            f"the load planner {type(planner).__name__} loads non-tensor values with its "
            "own load_bytes(), which takes pickled bytes; ckptvault never pickles: load "
            "with DCP's DefaultLoadPlanner, or a subclass that keeps its load_bytes"
        )
    missing = sorted(i.storage_index.fqn for i in items if i.storage_index.fqn not in values)
    if missing:
        raise FormatError(f"the generation holds no value {missing[:3]}")
    default: DefaultLoadPlanner = planner
    # A plugin save stores every tensor as one: a value where the caller holds a
    # tensor is a generation of another layout (or an edited one), never loaded.
    tensors = sorted(
        item.dest_index.fqn
        for item in items
        if isinstance(default.state_dict.get(item.dest_index.fqn), torch.Tensor)
    )
    if tensors:
        shown = ", ".join(repr(fqn[:200]) for fqn in tensors[:3])
        raise StateMismatchError(
            f"the generation stores {shown}{' ...' if len(tensors) > 3 else ''} as a JSON "
            "value, but the state dict holds a tensor there (a DCP plugin save stores "
            "every tensor as a tensor): this generation was not saved from this state "
            "dict's layout, or was edited. Nothing was loaded on this rank; load a "
            "generation saved from this layout",
            mismatched=tensors,
        )

    def set_values() -> None:
        for item in items:
            value = copy.deepcopy(values[item.storage_index.fqn])  # never shared between loads
            fqn = item.dest_index.fqn
            if default.flatten_state_dict:
                set_element(default.original_state_dict, default.mappings[fqn], value)
            else:
                default.state_dict[fqn] = value

    return set_values
