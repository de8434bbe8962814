"""Hugging Face Accelerate integration: ``save_state``/``load_state`` through ckptvault.

``pip install 'ckptvault[hf]'``. ``Accelerator.save_state`` pickles everything but the
weights (``optimizer.bin``, ``scheduler.bin``, ``random_states_0.pkl``,
``custom_checkpoint_0.pkl``), and its hooks (``register_save_state_pre_hook``) can
only take the weights over. :class:`Checkpointer` saves what ``save_state`` saves,
as one ckptvault generation, with nothing pickled::

    ckpt = Checkpointer(accelerator, mgr)   # after accelerator.prepare(...)
    info = ckpt.load_state()                # RestoreInfo, or None for an empty store
    ckpt.save_state(step)                   # one generation of `step`
    ckpt.save_state_if_due(step)            # ... when the manager's save_policy says so

A generation holds every object ``accelerator.prepare`` returned: models (unwrapped:
``model/``, ``model_1/``, ..., so ``ckptvault consolidate`` exports the first as
safetensors), optimizers and LR schedulers (their inner torch objects, so a plain
PyTorch loop restores them too), the grad scaler, each data loader's position (its
pass count, which seeds a seedable sampler, the sampler's seed, and a
``StatefulDataLoader``'s own state), the objects of
``accelerator.register_for_checkpointing`` (restored in place), the accelerator's
accumulation step, every RNG (``RNGState``, per rank), and ``extra`` entries of the
caller's (anything a ``CheckpointManager`` saves).

Data position: as with Accelerate, the loop knows how many batches of the current
epoch it trained and skips them with :meth:`Checkpointer.skip_first_batches` (instead
of ``accelerator.skip_first_batches``). It also sets the saved RNG states again
once the resumed pass has started (a data loader draws its worker seed from the
global RNG when a pass starts), so the resumed run continues bit-identically. A
pass's order must not depend on the global RNG at the time it starts: use a seedable
sampler (``DataLoaderConfiguration(use_seedable_sampler=True)``), also with
``use_stateful_dataloader=True`` (Accelerate's ``StatefulDataLoader`` does not save a
plain shuffling sampler's state; it then restores its own position, and
``skip_first_batches`` skips nothing more). Randomness inside data loading
(augmentation in ``collate_fn`` or workers) needs a generator of its own.

FSDP (``fsdp_version`` 1 or 2, any ``state_dict_type``): each model's weights and its
optimizer's state (model ``i`` with optimizer ``i``, as ``save_state`` pairs them) are
saved as every rank's shards, keyed by parameter name, through DCP's state-dict API
(:mod:`ckptvault.engines.fsdp`): one collective generation that restores at the same
number of ranks or another, into FSDP1 or FSDP2. DeepSpeed (ZeRO stages 1-3): the
engine's fp32 weights, optimizer state and counters, every rank its chunk
(:mod:`ckptvault.engines.deepspeed`), restorable at another number of ranks and
stage. Megatron-LM and XLA save through their own engines and are refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ckptvault.errors import UsageError
from ckptvault.integrations.accelerate_engines import REFUSED, EngineEntries, named
from ckptvault.state.rng import RNGState

if TYPE_CHECKING:
    from accelerate import Accelerator

    from ckptvault.manager import CheckpointManager, RestoreInfo
    from ckptvault.saving.handles import SaveHandle

__all__ = ["Checkpointer", "PreparedDataLoader"]


class Checkpointer:
    """Saves and restores an ``Accelerator``'s training state in a ``CheckpointManager``.

    Build it after ``accelerator.prepare(...)`` (and ``register_for_checkpointing``):
    the objects prepared then are what it saves and restores in place. ``extra``:
    further state entries (names other than the ones it uses itself).
    """

    def __init__(
        self,
        accelerator: Accelerator,
        manager: CheckpointManager,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        engine = str(getattr(accelerator.distributed_type, "value", accelerator.distributed_type))
        if engine in REFUSED:
            raise UsageError(
                f"ckptvault's Accelerate integration does not support {engine}: it saves "
                "through its own engine; use accelerator.save_state for it"
            )
        self.accelerator = accelerator
        self.manager = manager
        self.extra = dict(extra or {})
        self._rng: dict[str, Any] | None = None  # set again when the resumed pass starts
        # id(prepared loader) -> the skipping copy whose pass stands for its own.
        self._standins: dict[int, Any] = {}
        self._engine = EngineEntries(accelerator, engine)
        clash = sorted(set(self.extra) & set(self._own_names()))
        if clash:
            raise UsageError(
                f"extra entries {clash} clash with the Checkpointer's own: rename them"
            )

    def save_state(
        self,
        step: int,
        metrics: Mapping[str, float] | None = None,
        blocking: bool | None = None,
        **options: Any,
    ) -> SaveHandle:
        """``accelerator.save_state`` as one generation of ``step``; ``metrics``,
        ``blocking`` and ``options`` (``include_grads=``, ...) as for
        ``CheckpointManager.save``. Every rank calls it."""
        return self.manager.save(step, self._state(), blocking=blocking, metrics=metrics, **options)

    def save_state_if_due(
        self,
        step: int,
        metrics: Mapping[str, float] | None = None,
        blocking: bool | None = None,
        **options: Any,
    ) -> SaveHandle | None:
        """:meth:`save_state` when the manager's ``save_policy`` says ``step`` is due
        (``CheckpointManager.should_save``), else None. Every rank calls it after every
        step: a time rule's answer is agreed between the ranks, and a ``save_on_signal``
        signal makes this save the final one (``Preempted``)."""
        if not self.manager.should_save(step):
            return None
        return self.save_state(step, metrics, blocking, **options)

    def load_state(
        self, step: int | None = None, *, allow_rollback_to: int | None = None
    ) -> RestoreInfo | None:
        """``accelerator.load_state``: restore the newest generation that verifies (of
        ``step``, when given) into the prepared objects, in place. ``None`` (nothing
        changed) when the store holds no generation. Raises as
        ``CheckpointManager.restore``, leaving every object untouched: with a ledger,
        a ``step`` older than a newer generation that verifies is a ``RollbackError``
        unless ``allow_rollback_to`` names it. It takes a step, never a directory
        (``accelerator.load_state(input_dir)``'s form): nothing is read from a path
        anyone could have planted or renamed."""
        if step is not None and not isinstance(step, int):
            raise UsageError(
                f"load_state takes the step of a generation, not {step!r}: the Checkpointer "
                "keeps no directories (accelerator.load_state(input_dir) reads pickles). Pass "
                "load_state() for the newest that verifies, or load_state(step=N)"
            )
        state = self._state(restoring=True)
        try:
            info = self.manager.restore(state, step=step, allow_rollback_to=allow_rollback_to)
        except BaseException:
            self._engine.discard()
            raise
        if info is None:
            self._engine.discard()  # nothing changed: not even a fresh optimizer's state
        else:
            self._engine.apply()
        # The RNGs were just set to the saved states: read back, they are set again
        # when the resumed pass starts (skip_first_batches).
        self._rng = RNGState().state_dict() if info is not None else None
        return info

    def skip_first_batches(self, dataloader: Any, num_batches: int = 0) -> Iterable[Any]:
        """The rest of ``dataloader``'s current pass, after ``num_batches`` batches, as
        ``accelerator.skip_first_batches``; after a :meth:`load_state`, the saved RNG
        states are set again once the pass has started. A ``StatefulDataLoader``
        restored its own position: ``num_batches`` is not skipped again."""
        if num_batches < 0:
            raise UsageError(f"num_batches must be >= 0, got {num_batches}")
        rng, self._rng = self._rng, None
        if num_batches == 0:  # a pass from the start, as in the saved run
            return dataloader if rng is None else _ResumedPass(dataloader, rng, False)
        if getattr(dataloader, "use_stateful_dataloader", False):
            return _ResumedPass(dataloader, rng, True)
        skipped = self.accelerator.skip_first_batches(dataloader, num_batches)
        return _ResumedPass(skipped, rng, True, (dataloader, self._standins))

    # -- the state ------------------------------------------------------------------

    def _own_names(self) -> list[str]:
        rest = ["scheduler", "dataloader", "scaler", "accelerator", "rng"]
        return [*self._engine.names(), *rest]

    def _own_entries(self, restoring: bool) -> dict[str, Any]:
        accelerator = self.accelerator
        entries: dict[str, Any] = self._engine.entries(restoring)
        for index, scheduler in enumerate(accelerator._schedulers):
            entries[named("scheduler", index)] = getattr(scheduler, "scheduler", scheduler)
        for index, loader in enumerate(accelerator._dataloaders):
            standin = self._standins.get(id(loader))
            entries[named("dataloader", index)] = PreparedDataLoader(loader, standin)
        if accelerator.scaler is not None:
            entries["scaler"] = accelerator.scaler
        for index, custom in enumerate(accelerator._custom_objects):
            entries[f"custom_{index}"] = custom
        entries["accelerator"] = _AcceleratorStep(accelerator)
        entries["rng"] = RNGState()
        return entries

    def _state(self, restoring: bool = False) -> dict[str, Any]:
        return {**self._own_entries(restoring), **self.extra}


class PreparedDataLoader:
    """The position of one prepared data loader, as a stateful state entry: its pass
    count (``iteration``: the epoch that seeds a seedable sampler), the seedable
    sampler's seed, and a ``StatefulDataLoader``'s own state. Saved per rank (its
    name ends in ``DataLoader``: see ``ckptvault.state.ranks``). ``standin``: the
    skipping copy whose pass is this loader's current one."""

    def __init__(self, loader: Any, standin: Any = None) -> None:
        self.loader, self.standin = loader, standin

    def _sampler(self) -> Any:
        get = getattr(self.loader, "get_sampler", None)
        sampler = get() if callable(get) else None
        return sampler if hasattr(sampler, "initial_seed") else None

    def _iteration(self) -> int:
        """The pass to start after a resume: a pass whose last batch was handed out
        counts as done (its loader counts it only when asked for the next batch)."""
        source = self.standin if self.standin is not None else self.loader
        iteration = int(getattr(source, "iteration", 0))
        gradient_state = getattr(source, "gradient_state", None)
        in_pass = any(ref is source for ref in getattr(gradient_state, "dataloader_references", ()))
        return (
            iteration + 1 if in_pass and getattr(source, "end_of_dataloader", False) else iteration
        )

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"iteration": self._iteration()}
        sampler = self._sampler()
        if sampler is not None:
            state["sampler_seed"] = int(sampler.initial_seed)
        if getattr(self.loader, "use_stateful_dataloader", False):
            state["loader"] = self.loader.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if hasattr(self.loader, "set_epoch"):
            self.loader.set_epoch(int(state["iteration"]))
        sampler = self._sampler()
        if sampler is not None and "sampler_seed" in state:
            sampler.initial_seed = int(state["sampler_seed"])
        if "loader" in state:
            saved = state["loader"]
            # A pass that was over: the next starts afresh, as it would have (a
            # StatefulDataLoader given a finished state would start two iterators).
            finished = isinstance(saved, Mapping) and saved.get("_iterator_finished") is True
            self.loader.load_state_dict({} if finished else saved)


class _AcceleratorStep:
    """``accelerator.step``: where gradient accumulation stands."""

    def __init__(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict[str, Any]:
        return {"step": int(self.accelerator.step)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.accelerator.step = int(state["step"])


class _ResumedPass:
    """One pass over ``loader`` that sets ``rng`` once it has started: before the first
    batch when ``after_first`` is False (a pass from the start: the loader's own draws
    come after, as in the saved run), after it otherwise (the saved run had started
    this pass long before). ``standing_in``: (the prepared loader a skipping copy
    stands in for, the Checkpointer's stand-in table): saves during the pass read the
    copy's position, and the prepared loader goes on with the next pass after it."""

    def __init__(
        self,
        loader: Any,
        rng: dict[str, Any] | None,
        after_first: bool,
        standing_in: tuple[Any, dict[int, Any]] | None = None,
    ) -> None:
        self.loader, self.rng, self.after_first = loader, rng, after_first
        self.standing_in = standing_in

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        rng, self.rng = self.rng, None
        if rng is not None and not self.after_first:
            RNGState().load_state_dict(rng)
        if self.standing_in is None:
            yield from self._batches(rng)
            return
        original, standins = self.standing_in
        standins[id(original)] = self.loader
        try:
            yield from self._batches(rng)
        finally:
            standins.pop(id(original), None)
        # The copy counted this pass; the loader it stands in for starts the next.
        original.set_epoch(int(self.loader.iteration))

    def _batches(self, rng: dict[str, Any] | None) -> Iterator[Any]:
        for index, batch in enumerate(self.loader):
            if index == 0 and rng is not None and self.after_first:
                RNGState().load_state_dict(rng)
            yield batch
