"""PyTorch Lightning: a ``CheckpointIO`` that writes ckptvault generations, never pickles.

::

    trainer = pl.Trainer(plugins=[CkptvaultCheckpointIO("ckpt/run42", run_id="run42")],
                         callbacks=[ModelCheckpoint(dirpath="runs/run42", save_last=True)])
    trainer.fit(model, loader, ckpt_path="last")

Lightning hands the plugin its whole checkpoint dict: the module's ``state_dict``,
``optimizer_states``, ``lr_schedulers``, the loops' progress (and a stateful data
loader's position), the callbacks' states keyed by their ``state_key``,
``hyper_parameters`` and whatever ``on_save_checkpoint`` added. The plugin saves it
as one generation of the step ``checkpoint["global_step"]``: tensors in tensor files,
everything else through the strict JSON codec. Anything the codec cannot represent
(a class or function in the hyperparameters, say) is an
:class:`~ckptvault.errors.UnsupportedValueError` naming its key path, e.g.
``checkpoint['hyper_parameters']['activation']``, raised before anything is written.

At the path Lightning names (``.../epoch=0-step=10.ckpt``, ``last.ckpt``) the plugin
writes a small JSON *pointer* to that generation
(:mod:`ckptvault.integrations.lightning_pointers`), so ``ModelCheckpoint``'s file
logic, ``save_last="link"`` and ``ckpt_path="last"`` work unchanged. A pointer is
only a hint: whoever can write ``ModelCheckpoint``'s directory can copy an old one
over another. Loading ``last*.ckpt`` (what ``ckpt_path="last"`` picks) restores the
newest generation that verifies, whatever step the pointer names; loading any other
pointer restores its step as ``restore(state, step=...)`` does, so with a ledger a
step older than a newer generation that verifies is a ``RollbackError`` unless
``allow_rollback_to`` names it. The whole generation is verified (digests, signature
and rollback floor with the manager's trust options) before Lightning sees a byte of
it, and the dict comes back with the same keys, nesting, key order and types
(tuples, int keys, ``OrderedDict``, the module state's ``_metadata``). Removing a
checkpoint removes its pointer and prunes the generation the plugin put at that path
(its record in the store says which, never the file:
:mod:`ckptvault.integrations.lightning_records`) through ckptvault's retention
machinery (:mod:`ckptvault.integrations.lightning_prune`).

Saves are synchronous, and the pointer is written only once its generation is
durable. Lightning's own strategies call ``save_checkpoint`` on global rank 0 only,
with rank 0's dict: with several ranks, use ckptvault's strategies
(:mod:`ckptvault.integrations.lightning_strategies`), under which every rank saves and
loads its own part collectively (:mod:`ckptvault.integrations.lightning_ranks`).
"""

from __future__ import annotations

import functools
import logging
import os
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.utilities.types import _PATH

from ckptvault.config import validate_step
from ckptvault.coordinator import Coordinator, SingleProcess
from ckptvault.durable import fsync_directory
from ckptvault.engines.fsdp import optimizer_problems
from ckptvault.errors import (
    NoValidCheckpoint,
    SaveFailedError,
    StateMismatchError,
    UnsupportedValueError,
    UsageError,
)
from ckptvault.integrations.lightning_pointers import (
    SUFFIX,
    Pointer,
    parse_pointer,
    read_pointer,
    try_read_pointer,
    write_pointer,
)
from ckptvault.integrations.lightning_prune import LightningPruner
from ckptvault.integrations.lightning_ranks import OWN, agree, own_part, put_back, shared_part
from ckptvault.manager import CheckpointManager, RestoreInfo
from ckptvault.state.checked import Checked, layout_problems, skeleton
from ckptvault.state.codec import Encoder, KeyPath
from ckptvault.state.codec_names import format_path
from ckptvault.state.ranks import unwrap

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from ckptvault.assembly import ManagerOptions
    from ckptvault.storage import StoreLocation

__all__ = ["CkptvaultCheckpointIO"]

logger = logging.getLogger("ckptvault")

# ModelCheckpoint.CHECKPOINT_NAME_LAST: "last" pointers stand for the newest generation.
LAST_PREFIX = "last"

# The saved state: Lightning's dict under one key, and the module state's per-submodule
# versions (``state_dict()._metadata``, an attribute the JSON tree cannot carry).
CHECKPOINT = "lightning"
MODULE_METADATA = "module_metadata"

_HINTS = {
    "hyper_parameters": "save_hyperparameters() recorded it: leave it out with "
    "self.save_hyperparameters(ignore=[...]) and keep plain config values instead",
    "hyper_parameters_type": "OmegaConf hyperparameters record their class: pass "
    "OmegaConf.to_container(cfg) to save_hyperparameters() instead",
    "callbacks": "a callback's state_dict() returned it: make it return tensors and plain values",
}
_DEFAULT_HINT = "put only tensors and plain values into the checkpoint (on_save_checkpoint)"


class CkptvaultCheckpointIO(CheckpointIO):
    """Lightning checkpoints as verified ckptvault generations in ``store``.

    Args:
        store: the ckptvault store (a local path, ``s3://`` or ``az://`` URL); the
            pointers stay at the (local) paths ``ModelCheckpoint`` chooses.
        delete_delay: seconds between Lightning removing a checkpoint (``save_top_k``,
            an overwritten ``last.ckpt``) and its generation's bytes going: it is marked
            at once (no longer a restore candidate; ``ckptvault gc --undelete STEP``
            brings it back) and deleted by a later removal after the delay. 0 (the
            default) deletes at once what retention's safety net does not keep.
        allow_rollback_to: a step to roll back to on purpose: the first load of a
            pointer of that step restores it with ``restore(state,
            allow_rollback_to=STEP)`` (with a ledger: the floor is lowered, newer
            generations are abandoned, a WARNING and an audit entry say so). Never
            applies to ``last*.ckpt``. Remove it once the rollback is done.
        options: :class:`~ckptvault.CheckpointManager` options (``run_id``,
            ``signing_key``, ``trusted_keys``, ``keystore``, ``contract``,
            ``collective_timeout_s``, ...), except ``coordinator`` and ``async_save``:
            saves are synchronous, on the ranks Lightning's strategy calls it on.

    ``restore_info`` is the :class:`~ckptvault.RestoreInfo` of the last load.
    ``every_rank`` is set by ckptvault's strategies: Lightning calls the plugin on
    every rank, which save and load together.
    """

    def __init__(
        self,
        store: StoreLocation,
        *,
        delete_delay: float = 0.0,
        allow_rollback_to: int | None = None,
        **options: Unpack[ManagerOptions],
    ) -> None:
        for refused in ("coordinator", "async_save"):
            if refused in options:
                raise UsageError(
                    f"CkptvaultCheckpointIO does not take {refused}=: the ranks that save "
                    "are those Lightning's strategy calls it on (rank 0, or every rank "
                    "under ckptvault's strategies), and each pointer is written once its "
                    "generation is durable, so saves are synchronous"
                )
        if not isinstance(delete_delay, (int, float)) or not 0 <= delete_delay < float("inf"):
            raise UsageError(f"delete_delay must be a number of seconds >= 0, got {delete_delay!r}")
        self.store = store
        self.delete_delay = float(delete_delay)
        self.allow_rollback_to = (
            None
            if allow_rollback_to is None
            else validate_step(allow_rollback_to, "allow_rollback_to")
        )
        self.restore_info: RestoreInfo | None = None
        self._options = options
        self._manager: CheckpointManager | None = None
        self._pruner: LightningPruner | None = None
        self._written: tuple[int, str] | None = None  # (step, generation id) saved last
        self.every_rank = False
        self._warned_rank0 = False

    @property
    def manager(self) -> CheckpointManager:
        """The :class:`~ckptvault.CheckpointManager` of ``store``, opened on first use
        (and again after :meth:`teardown` closed it)."""
        if self._manager is None:
            options: ManagerOptions = {**self._options}
            if not self.every_rank:  # else the torch.distributed job's, on every rank
                options["coordinator"] = SingleProcess()
            manager = CheckpointManager(self.store, **options)
            self._manager, self._pruner = manager, LightningPruner(manager, self.delete_delay)
        return self._manager

    @property
    def pruner(self) -> LightningPruner:
        self.manager  # noqa: B018 - opens the manager and its pruner
        assert self._pruner is not None
        return self._pruner

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` as a generation of step ``checkpoint["global_step"]`` and
        put a pointer to it at ``path``. Durable when this returns."""
        if storage_options is not None:
            raise UsageError(
                "CkptvaultCheckpointIO takes no storage_options: configure the store and "
                "trust options on the plugin"
            )
        target = _local_path(path)
        step = _global_step(checkpoint)
        self._warn_if_rank0_only()
        manager = self.manager
        ranks = manager.coordinator
        # Before anything is written, naming the key (on every rank alike).
        agree(ranks, "save its checkpoint", lambda: check_encodable(checkpoint), SaveFailedError)
        generation_id = ranks.broadcast(self._written_at(step) if ranks.is_coordinator else None)
        if generation_id is None:
            info = manager.save(step, _saved_state(checkpoint, ranks)).result()
            assert info is not None  # a synchronous save is never skipped
            generation_id = info.generation_id
        self._written = (step, generation_id)
        pointer = Pointer(manager.run_id, step, generation_id, manager.store.location)
        agree(ranks, f"write {target}", lambda: self._point(target, pointer), SaveFailedError)

    def _point(self, target: Path, pointer: Pointer) -> None:
        """Rank 0 puts the pointer at ``target``; what was there before is released by
        the store's record of it, not by the file."""
        if self.manager.coordinator.is_coordinator:
            write_pointer(target, pointer)
            self.pruner.pointed(target, pointer.name)

    def _warn_if_rank0_only(self) -> None:
        if self.every_rank or self._warned_rank0:
            return
        world = torch.distributed.get_world_size() if _distributed() else 1
        if world > 1:
            self._warned_rank0 = True
            logger.warning(
                "CkptvaultCheckpointIO saves the checkpoint Lightning hands to rank 0 of %d: "
                "the other ranks' RNG states, data loader positions and callback states are "
                "not saved, and a resume gives them rank 0's. Use ckptvault's strategy "
                "(strategy=CkptvaultDDPStrategy() from ckptvault.integrations."
                "lightning_strategies) to save every rank's",
                world,
            )

    def _written_at(self, step: int) -> str | None:
        """The generation this plugin saved for ``step`` last, if it is still listed:
        a second save of the same global step (``save_last=True``: the top-k file and
        ``last.ckpt``) points at it instead of writing the same state again, as
        Lightning's own ``save_last="link"`` does."""
        if self._written is None or self._written[0] != step:
            return None
        listed = {g.generation_id for g in self.manager.generations()}
        return self._written[1] if self._written[1] in listed else None

    def load_checkpoint(
        self,
        path: _PATH,
        map_location: Any | None = None,
        weights_only: bool | None = None,
        *,
        into: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The checkpoint the pointer at ``path`` stands for, verified before it is
        returned: for ``last*.ckpt`` the newest generation that verifies, otherwise
        the pointer's step (see the module docstring).

        Tensors come back on the CPU, or on ``map_location`` (a device or its name).
        ``weights_only`` changes nothing: nothing here is unpickled, ever. ``into``:
        entries of the dict to restore in place (the sharded ``state_dict`` a strategy
        holds, as DTensors: each rank reads its shards only)."""
        device = _device(map_location)
        target = _local_path(path)
        manager = self.manager
        pointer = self._read_pointer(manager.coordinator, target)
        if pointer.run_id != manager.run_id:
            raise UsageError(
                f"{path} points to a checkpoint of run {pointer.run_id!r}, but this plugin "
                f"reads run {manager.run_id!r}: pass run_id={pointer.run_id!r} to "
                "CkptvaultCheckpointIO to load it"
            )
        if pointer.store != manager.store.location:
            logger.warning(
                "%s was written to store %s; reading it from %s",
                path,
                pointer.store,
                manager.store.location,
            )
        entry = dict(into or {})  # templates to fill: checked before anything is applied
        checked = Checked(entry, functools.partial(_into_problems, skeleton(entry)))
        state: dict[str, Any] = {CHECKPOINT: checked if into else entry, MODULE_METADATA: None}
        info = self._restore_ranked(state, target, pointer)
        if info is None:
            raise NoValidCheckpoint(
                f"{path} points to step {pointer.step}, but {manager.store.location} holds "
                "no generation at all: was the store moved? Pass its location to "
                "CkptvaultCheckpointIO"
            )
        self.restore_info = info
        if info.generation_id != pointer.generation_id:
            logger.log(
                logging.WARNING if info.step != pointer.step else logging.INFO,
                "%s names generation %s (step %d); restored %s (step %d), the newest %s "
                "that verifies",
                path,
                pointer.generation_id,
                pointer.step,
                info.generation_id,
                info.step,
                "generation" if is_last_pointer(target) else f"of step {pointer.step}",
            )
        checkpoint: dict[str, Any] = unwrap(state[CHECKPOINT])
        own = state[OWN].value if OWN in state else None
        # Saved by more ranks (its per-rank parts reset) or by one process (none).
        resharded = OWN in info.reset or (manager.coordinator.world_size > 1 and own is None)
        put_back(checkpoint, own, resharded, str(path))
        weights = checkpoint.get("state_dict")
        if isinstance(weights, OrderedDict) and isinstance(state[MODULE_METADATA], dict):
            weights._metadata = state[MODULE_METADATA]  # type: ignore[attr-defined]
        return _to_device(checkpoint, device) if device is not None else checkpoint

    def _read_pointer(self, ranks: Coordinator, target: Path) -> Pointer:
        """The pointer at ``target``, read by rank 0 and sent to the others (a checkpoint
        directory need not be shared by every node)."""
        if ranks.world_size == 1:
            return read_pointer(target)
        data = agree(
            ranks,
            f"read {target}",
            lambda: read_pointer(target).to_bytes().decode() if ranks.is_coordinator else None,
            NoValidCheckpoint,
        )
        sent = ranks.broadcast(data)
        return parse_pointer(str(sent).encode(), f"{target} (read by rank 0)")

    def _restore_ranked(
        self, state: dict[str, Any], target: Path, pointer: Pointer
    ) -> RestoreInfo | None:
        """:meth:`_restore`, with each rank's own part when several ranks load (from a
        generation one process saved, which has none: without it)."""
        if self.manager.coordinator.world_size == 1:
            return self._restore(state, target, pointer)
        state[OWN] = own_part({})
        try:
            return self._restore(state, target, pointer)
        except StateMismatchError as exc:  # every rank alike: nothing was applied
            if exc.missing != [format_path((OWN,))] or exc.unexpected or exc.mismatched:
                raise
        del state[OWN]
        return self._restore(state, target, pointer)

    def _restore(self, state: dict[str, Any], target: Path, pointer: Pointer) -> RestoreInfo | None:
        """``last*.ckpt``: the newest that verifies (the pointer is only a hint; a
        planted old one must not roll the run back). Any other pointer: its step, which
        with a ledger is a rollback when a newer generation verifies, allowed only by
        ``allow_rollback_to`` (honoured once)."""
        manager = self.manager
        if is_last_pointer(target):
            return manager.restore(state)
        if self.allow_rollback_to is not None and pointer.step == self.allow_rollback_to:
            info = manager.restore(state, allow_rollback_to=pointer.step)
            self.allow_rollback_to = None  # done: a later load is held to the rule again
            return info
        return manager.restore(state, step=pointer.step)

    def remove_checkpoint(self, path: _PATH) -> None:
        """Remove the pointer at ``path`` and let its generation go (unless another
        pointer still names it), through ckptvault's retention rules."""
        target = _local_path(path)
        if self.every_rank and not self.manager.coordinator.is_coordinator:
            return  # every rank opened the manager (together); rank 0 removes
        if not os.path.lexists(target):
            return
        if try_read_pointer(target) is None and not target.is_symlink():
            logger.warning("leaving %s alone: it is not a pointer this plugin wrote", target)
            return
        target.unlink()  # a link (save_last="link") goes, never what it points to
        fsync_directory(target.parent)
        # Releases what the plugin put at this path (the store's record), not what the
        # file said: a link, or a pointer someone rewrote, releases nothing else.
        self.pruner.removed(target)

    def teardown(self) -> None:
        """Close the manager (waits for nothing: saves are synchronous) and release the
        store's writer lock; the next call opens it again."""
        manager, self._manager = self._manager, None
        if manager is not None:
            manager.close()


def is_last_pointer(path: Path) -> bool:
    """Whether ``path`` is one of ``ModelCheckpoint``'s "last" checkpoints
    (``last.ckpt``, ``last-v1.ckpt``, ...: what ``ckpt_path="last"`` chooses among,
    by the same rule Lightning uses: the name begins with ``last``)."""
    return path.suffix == SUFFIX and path.name.startswith(LAST_PREFIX)


def check_encodable(checkpoint: Mapping[str, Any]) -> None:
    """Raise :class:`UnsupportedValueError` naming the first key path (as
    ``checkpoint['hyper_parameters']['act']``) the codec cannot store.

    Stricter than the manager's capture on purpose: objects with ``state_dict()``,
    generators and ``RNGState`` inside a Lightning dict would need a live object to be
    restored into, which ``load_checkpoint`` does not have; they are refused too."""
    encoder = Encoder(_no_tensor_sink)
    for key, value in checkpoint.items():
        if type(key) is not str:
            raise UnsupportedValueError(f"checkpoint[{key!r}]", key, "top-level keys must be str")
        try:
            encoder.encode(value, (key,))
        except UnsupportedValueError as exc:
            path = "checkpoint" + exc.path.removeprefix("state")
            message = str(exc).replace(exc.path, path, 1)
            exc.path = path
            exc.args = (f"{message}; {_HINTS.get(key, _DEFAULT_HINT)}",)
            raise


def _no_tensor_sink(path: KeyPath, tensor: torch.Tensor) -> str:
    return ""  # only checking: the manager's capture collects the tensors


def _saved_state(checkpoint: dict[str, Any], ranks: Coordinator) -> dict[str, Any]:
    metadata = getattr(checkpoint.get("state_dict"), "_metadata", None)
    plain = None
    if isinstance(metadata, Mapping) and all(
        type(k) is str and isinstance(v, Mapping) for k, v in metadata.items()
    ):
        plain = {prefix: dict(versions) for prefix, versions in metadata.items()}
    if ranks.world_size == 1:
        return {CHECKPOINT: checkpoint, MODULE_METADATA: plain}
    return {
        CHECKPOINT: shared_part(checkpoint, ranks.rank),
        MODULE_METADATA: plain,
        OWN: own_part(checkpoint),
    }


def _into_problems(layout: dict[str, Any], saved: Any) -> list[str]:
    """Why the saved checkpoint dict cannot fill the templates a strategy restores in
    place (``into``: the sharded ``state_dict`` and ``optimizer_states`` that DCP's
    setters load next; their tensors are the live model's and optimizer's own)."""
    if not isinstance(saved, Mapping):
        return [f": the checkpoint holds {type(saved).__name__}, not Lightning's dict"]
    problems = []
    if "state_dict" in layout:
        weights = saved.get("state_dict")
        problems += layout_problems(layout["state_dict"], weights, "['state_dict']", complete=False)
    if "optimizer_states" in layout:
        live, states = layout["optimizer_states"], saved.get("optimizer_states")
        if not isinstance(states, list) or len(states) != len(live):
            shown = f"{len(states)}" if isinstance(states, list) else type(states).__name__
            return [
                *problems,
                f"['optimizer_states']: the checkpoint holds {shown}, the strategy "
                f"{len(live)} optimizers: configure the optimizers the run was saved with",
            ]
        for index, (optimizer, state) in enumerate(zip(live, states, strict=True)):
            problems += optimizer_problems(optimizer, state, f"['optimizer_states'][{index}]")
    return problems


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _global_step(checkpoint: Mapping[str, Any]) -> int:
    step = checkpoint.get("global_step")
    try:
        return validate_step(step, "the checkpoint's global_step")
    except UsageError:
        raise UsageError(
            f"CkptvaultCheckpointIO saves Lightning training checkpoints, which carry their "
            f"global_step; this one has {step!r} (ddp_spawn's weight hand-over is not "
            "supported: use strategy='ddp')"
        ) from None


def _local_path(path: _PATH) -> Path:
    text = os.fspath(path)
    if "://" in text and not text.startswith("file://"):
        raise UsageError(
            f"{text}: checkpoint pointers are local files; give ModelCheckpoint a local "
            "dirpath (the store itself may be s3://...)"
        )
    return Path(os.path.abspath(text.removeprefix("file://")))


def _device(map_location: Any) -> torch.device | None:
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        return torch.device(map_location)
    raise UsageError(
        f"map_location={map_location!r}: CkptvaultCheckpointIO loads tensors onto the CPU "
        "or the one device given (a torch.device or its name), nothing else"
    )


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):  # OrderedDict too: moved in place, keeping _metadata
        for key, item in value.items():
            value[key] = _to_device(item, device)
        return value
    if isinstance(value, list):
        value[:] = [_to_device(item, device) for item in value]
        return value
    if type(value) is tuple:  # not torch.Size or a named tuple
        return tuple(_to_device(item, device) for item in value)
    return value
