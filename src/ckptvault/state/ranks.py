"""Which entries of a multi-rank job's state belong to one rank, and which to all.

In a job of several ranks, most of the state is the job's: weights and optimizer
state (sharded or replicated, DCP knows which), the schedule, counters such as
``{"tokens_seen": ...}``. Some of it is each rank's own and means nothing on another
rank: the global RNGs (:class:`~ckptvault.state.rng.RNGState`), independent
generators, and the position of a rank's data loader. A top-level entry is *per
rank* when its value is one of those, a data loader (anything stateful whose class
is named ``...DataLoader``), or wrapped in :class:`PerRank`.

A save of N > 1 ranks stores the coordinator's tree of the job's entries once and
every rank's tree of its own entries (``{"global": {...}, "ranks": [{...}, ...]}``,
recognised by the manifest's ``writer.world_size``), with per-rank tensors under
``rank<r>/`` keys so that DCP never takes one rank's RNG for a replica of another's.
A restore at the same world size gives every rank its own entries back; at another
world size they no longer mean anything, so they are left as they are and named in
``RestoreInfo.reset``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ckptvault.errors import FormatError
from ckptvault.state.capture import CapturedState, capture_state, is_stateful
from ckptvault.state.checked import Checked
from ckptvault.state.param_names import parameter_names
from ckptvault.state.rng import RNGState

GLOBAL = "global"
RANKS = "ranks"


class PerRank:
    """Marks a state entry as this rank's own: ``state["sampler"] = PerRank(sampler)``.

    Saved per rank and restored to the same rank when the world size is unchanged."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"PerRank({self.value!r})"


def is_per_rank(value: Any) -> bool:
    """Whether a top-level state entry is each rank's own (see the module docstring)."""
    if isinstance(value, (PerRank, RNGState, np.random.Generator, torch.Generator)):
        return True
    return is_stateful(value) and type(value).__name__.endswith("DataLoader")


def unwrap(value: Any) -> Any:
    """A top-level entry's value, without its wrapper (:class:`PerRank`, or a
    restore template's :class:`~ckptvault.state.checked.Checked`)."""
    return value.value if isinstance(value, (PerRank, Checked)) else value


def unwrap_entries(state: Any) -> Any:
    """``state`` without its top-level ``PerRank`` wrappers (on one process a rank's
    own entries are plain ones); anything but a mapping as it is."""
    if not isinstance(state, Mapping):
        return state
    return {key: unwrap(value) for key, value in state.items()}


def rank_entry(rank: int) -> str:
    """The key path prefix of rank ``rank``'s own tensors."""
    return f"rank{rank}"


def capture_ranked(state: Mapping[str, Any], rank: int) -> CapturedState:
    """Capture ``state`` for a multi-rank save: the job's entries as usual, this
    rank's own under ``rank<r>/`` tensor keys and in ``CapturedState.rank_tree``."""
    shared = {key: unwrap(value) for key, value in state.items() if not is_per_rank(value)}
    own = {key: unwrap(value) for key, value in state.items() if is_per_rank(value)}
    names = parameter_names(state)  # the job's modules, as restore names them
    captured = capture_state(shared, names)
    mine = capture_state({rank_entry(rank): own}, names)
    return CapturedState(
        tree=captured.tree,
        tensors={**captured.tensors, **mine.tensors},
        rank_tree=mine.tree[rank_entry(rank)],
    )


def compose(global_tree: dict[str, Any], rank_trees: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest state of a multi-rank save."""
    return {GLOBAL: global_tree, RANKS: rank_trees}


def tree_for_rank(
    state: Any, saved_world: int, rank: int, world_size: int, where: str
) -> tuple[dict[str, Any], list[str]]:
    """The state tree rank ``rank`` of ``world_size`` restores from a manifest state
    written by ``saved_world`` ranks, and the per-rank entries it cannot restore."""
    if saved_world == 1:
        if not isinstance(state, dict):
            raise FormatError(f"{where}: the state tree is not an object")
        return state, []
    if not (
        isinstance(state, dict)
        and set(state) == {GLOBAL, RANKS}
        and isinstance(state[GLOBAL], dict)
        and isinstance(state[RANKS], list)
        and len(state[RANKS]) == saved_world
        and all(isinstance(tree, dict) for tree in state[RANKS])
    ):
        raise FormatError(
            f"{where}: the manifest says {saved_world} ranks wrote it, but its state is not "
            f"one global tree and {saved_world} per-rank trees"
        )
    tree = dict(state[GLOBAL])
    per_rank = sorted({key for own in state[RANKS] for key in own})
    if world_size != saved_world:
        return tree, per_rank
    own = state[RANKS][rank]
    strangers = sorted(
        k for k in tensor_references(own) if not k.startswith(f"{rank_entry(rank)}/")
    )
    if strangers:
        raise FormatError(
            f"{where}: rank {rank}'s own entries refer to tensors that are not its own "
            f"({', '.join(repr(k[:100]) for k in strangers[:3])})"
        )
    overlap = sorted(set(own) & set(tree))
    if overlap:
        raise FormatError(f"{where}: entries {overlap} are both global and per-rank")
    tree.update(own)
    return tree, []


def leave_per_rank_alone(
    live: Mapping[str, Any], saved: dict[str, Any], saved_world: int, world_size: int
) -> list[str]:
    """When the world size changed, the live per-rank entries that ``saved`` still
    holds (a one-process save keeps its RNG among the job's entries) are taken out
    of it; returns their names. Nothing changes at the same world size."""
    if saved_world == world_size:
        return []
    dropped = sorted(key for key, value in live.items() if is_per_rank(value) and key in saved)
    for key in dropped:
        del saved[key]
    return dropped


def tensor_references(tree: Any) -> set[str]:
    """Every tensor key a (JSON) state tree refers to (``{"$tensor": key}``)."""
    found: set[str] = set()
    pending: list[Any] = [tree]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            if set(node) == {"$tensor"} and isinstance(node["$tensor"], str):
                found.add(node["$tensor"])
            else:
                pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return found
