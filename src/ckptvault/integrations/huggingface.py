"""Hugging Face ``Trainer`` integration: checkpoints through ckptvault, exact resume.

``pip install 'ckptvault[hf]'``. :class:`CkptvaultTrainer` is a ``transformers.Trainer``
that saves on the Trainer's own save steps (``save_strategy``, ``save_steps``) into a
:class:`~ckptvault.CheckpointManager` instead of ``checkpoint-N`` directories, and
resumes from it with ``trainer.train(resume_from_checkpoint=True)``. Another Trainer
class (``Seq2SeqTrainer``, TRL's ``SFTTrainer``) gets the same with
``class MyTrainer(CkptvaultTrainer, SFTTrainer): pass``.

Every save is one generation of step ``state.global_step`` holding the whole
transition: the model (``model/``, so ``ckptvault consolidate`` exports it as Hugging
Face safetensors), the optimizer's and LR scheduler's state dicts, the grad scaler's,
every RNG (``RNGState``: Python, NumPy, torch CPU and CUDA, per rank) and the
``TrainerState`` (global step, epoch, log history, stateful callbacks) as JSON. The
log entries of the step go into the manifest's ``metrics`` (``loss``, ``eval_loss``,
...), where retention's ``keep_best`` can use them. Trainer writes no ``checkpoint-N``
directory, so none of its pickles (``optimizer.pt``, ``scheduler.pt``,
``rng_state.pth``, ``training_args.bin``); retention replaces ``save_total_limit``.

A path is only a hint (:mod:`ckptvault.integrations.resume_paths`): once the run has
history, ``.../checkpoint-N`` is step N from the store, under restore's rollback rule
(``train(..., allow_rollback_to=N)`` goes back on purpose); any other path is refused.

Resuming goes through Trainer's own resume path, so that it positions the data
exactly as Trainer does: the generation is restored (and verified) where Trainer would
load its model; the TrainerState goes to Trainer as the JSON file it reads (in a
private temporary directory: its only file); the optimizer, scheduler and scaler are
loaded where Trainer loads theirs (after it built them); Trainer then skips the
batches already trained, and the saved RNG states are set again where Trainer sets
its own (after the first batch of the resumed epoch is fetched). The resumed run
continues bit-identically: same losses, logs and final weights as an uninterrupted
run, on bit-reproducible kernels (see "Bit-exact resume" in docs/guides/restoring.md).

This relies on Trainer's checkpoint hooks (``_save_checkpoint``,
``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_rng_state``,
and ``_load_scaler`` where Trainer has it); the class refuses to be built when one
is missing, rather than resume silently from nothing. Checkpoints are not pushed to
the Hub as they are saved (``hub_strategy``: there is no directory to push); a final
``trainer.push_to_hub()`` works as before.

FSDP (``fsdp_config={"version": 1 or 2}``, any ``state_dict_type``): the weights and
the optimizer's state are saved as every rank's shards, keyed by parameter name,
through DCP's state-dict API (:mod:`ckptvault.engines.fsdp`); the generation restores
at the same number of ranks or another, into FSDP1 or FSDP2. DeepSpeed (ZeRO stages
1-3): the engine's fp32 weights, optimizer state and counters, every rank its chunk
(:mod:`ckptvault.engines.deepspeed`), in place of ``engine.save_checkpoint``'s
pickles; Trainer's ``deepspeed_load_checkpoint`` reads the generation instead while
``train`` runs. Not supported (refused at construction): FSDP on XLA,
``load_best_model_at_end`` (it reloads a ``checkpoint-N`` directory: restore the best
step with ``mgr.restore(..., step=trainer.state.best_global_step)``) and
``save_only_model``.

A manager with a save policy (``CheckpointManager(..., save_policy=cv.Every(...))``,
:mod:`ckptvault.saving.policy`) decides when the Trainer saves instead of
``save_strategy``/``save_steps``: after every optimizer step every rank asks
``should_save(global_step)`` (:class:`_PolicySaves`); the Trainer's save at the end of
training (``save_strategy="steps"``) stays, and a ``save_on_signal`` signal makes the
next step's save the final one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import transformers.trainer
from transformers import Trainer, TrainerState
from transformers.trainer_callback import ExportableState, TrainerCallback

from ckptvault.engines.deepspeed import DeepSpeedState
from ckptvault.engines.fsdp import ShardedState
from ckptvault.errors import NoValidCheckpoint, StateMismatchError, UsageError
from ckptvault.integrations.resume_paths import has_history, step_of_path
from ckptvault.state.rng import RNGState

if TYPE_CHECKING:
    from transformers.trainer_utils import TrainOutput

    from ckptvault.manager import CheckpointManager, RestoreInfo

__all__ = ["CkptvaultTrainer"]

logger = logging.getLogger("ckptvault")

TRAINER_STATE_FILE = "trainer_state.json"  # transformers.trainer.TRAINER_STATE_NAME
_HOOKS = (
    "_save_checkpoint",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_rng_state",
)
_METRIC_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:/-]{0,127}\Z")


@dataclass
class _Resume:
    """A resume in progress: what Trainer's hooks load, once the generation is restored."""

    directory: str  # the path Trainer is given as resume_from_checkpoint
    step: int | None  # None: the newest generation that verifies
    allow_rollback_to: int | None = None
    info: RestoreInfo | None = None
    # Under an engine: the restore that read the TrainerState first (it applied any
    # rollback; the weights must come from its generation).
    first: RestoreInfo | None = None
    optimizer: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)
    scaler: dict[str, Any] = field(default_factory=dict)
    rng: dict[str, Any] | None = None  # set again at Trainer's RNG sync point, once


class CkptvaultTrainer(Trainer):
    """A ``transformers.Trainer`` that saves into and resumes from a ``CheckpointManager``.

    ``checkpoint_manager`` (keyword) is the manager; everything else goes to the
    Trainer. Another Trainer class gets the same by putting this one first:
    ``class MyTrainer(CkptvaultTrainer, SFTTrainer)`` (both derive from ``Trainer``).
    ``train(resume_from_checkpoint=...)`` takes ``True`` (the newest generation that
    verifies; a fresh start only when the run has no history at all: no generation in
    any tier, marked or not, and none the ledger knows of), a step number (that step's
    generation), ``None``/``False`` (a fresh start), or a path: ``.../checkpoint-N``
    is step N once the run has history in the store (see the module docstring);
    before that, Trainer's own directory, read by Trainer itself (a way to move a run
    over). ``train(..., allow_rollback_to=N)`` passes ``allow_rollback_to`` to
    ``restore``. ``restore_info`` is the :class:`~ckptvault.RestoreInfo` of the last
    resume.
    """

    def __init__(self, *args: Any, checkpoint_manager: CheckpointManager, **kwargs: Any) -> None:
        missing = [name for name in _HOOKS if not callable(getattr(Trainer, name, None))]
        if missing:
            raise UsageError(
                f"this transformers version's Trainer has no {', '.join(missing)}; "
                "CkptvaultTrainer cannot save or resume through it: install a transformers "
                "version ckptvault supports (pip install 'ckptvault[hf]')"
            )
        super().__init__(*args, **kwargs)
        self.checkpoint_manager = checkpoint_manager
        self.restore_info: RestoreInfo | None = None
        self._ckptvault_resume: _Resume | None = None
        _refuse_unsupported(self)
        if checkpoint_manager.save_policy is not None:
            if str(getattr(self.args.save_strategy, "value", self.args.save_strategy)) == "best":
                raise UsageError(
                    "the CheckpointManager's save_policy decides when to save, and "
                    "save_strategy='best' decides too: set save_strategy='steps' (or 'no') "
                    "with a save policy, or give the manager none"
                )
            self.add_callback(_PolicySaves(checkpoint_manager))  # last: its answer stands

    # -- saving --------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any, *args: Any, **kwargs: Any) -> None:
        """Trainer's save step: one generation, and no ``checkpoint-N`` directory."""
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        _record_stateful_callbacks(self)
        self.checkpoint_manager.save(
            self.state.global_step, self._ckptvault_state(), metrics=_step_metrics(self.state)
        )

    def _ckptvault_state(self) -> dict[str, Any]:
        scaler = getattr(self.accelerator, "scaler", None)
        optimizer, scheduler = self.optimizer, self.lr_scheduler
        assert optimizer is not None and scheduler is not None  # built before any step
        engine = self._engine_state()
        weights = (
            dict(engine.capture())
            if engine is not None
            else {"model": self.model, "optimizer": optimizer.state_dict()}
        )
        return {
            **weights,
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict() if scaler is not None else {},
            "rng": RNGState(),
            "trainer_state": dataclasses.asdict(self.state),
        }

    # -- resuming ------------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | int | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
        *,
        allow_rollback_to: int | None = None,
        **kwargs: Any,
    ) -> TrainOutput:
        """Trainer's ``train``; ``resume_from_checkpoint`` and ``allow_rollback_to`` as
        the class docstring says. Returns once every save of the run is durable
        (``checkpoint_manager.wait()``)."""
        resume = self._plan_resume(resume_from_checkpoint)
        if allow_rollback_to is not None:
            if resume is None:
                raise UsageError(
                    "allow_rollback_to= rolls back to a generation of the store: resume "
                    "with resume_from_checkpoint=True or the step"
                )
            resume.allow_rollback_to = allow_rollback_to
        self._ckptvault_resume = resume
        target: str | bool | None
        if resume is not None:
            target = resume.directory
        elif isinstance(resume_from_checkpoint, str):
            target = resume_from_checkpoint  # Trainer's own directory, read by Trainer
        else:
            target = None
        try:
            engine = self.is_fsdp_enabled or self.is_deepspeed_enabled
            if resume is not None and engine:
                self._read_trainer_state(resume)
            with self._deepspeed_loads_from_the_store():
                output = super().train(target, trial, ignore_keys_for_eval, **kwargs)
        finally:
            self._ckptvault_resume = None
            if resume is not None:
                shutil.rmtree(resume.directory, ignore_errors=True)
        self.checkpoint_manager.wait()
        return output

    def _plan_resume(self, request: str | bool | int | None) -> _Resume | None:
        if isinstance(request, str):
            request = step_of_path(self.checkpoint_manager, request)
        if request is None or request is False or isinstance(request, str):
            return None
        if request is True:
            # Fresh only where restore itself would start over: once the run has history,
            # restore decides (planted marks, an emptied tier: its typed refusal).
            if not has_history(self.checkpoint_manager):
                logger.info(
                    "%r holds no generation: training starts fresh", self.checkpoint_manager
                )
                return None
            step = None
        elif isinstance(request, int):
            step = request
        else:
            raise UsageError(
                f"resume_from_checkpoint must be True, a step number, None or a path, "
                f"not {type(request).__name__}"
            )
        return _Resume(tempfile.mkdtemp(prefix="ckptvault-resume-"), step)

    @contextlib.contextmanager
    def _deepspeed_loads_from_the_store(self) -> Any:
        """Under DeepSpeed, Trainer loads a resumed run's weights with the module
        function ``deepspeed_load_checkpoint`` (no method to override): while
        ``train`` runs, a resume of ours goes to :meth:`_load_from_checkpoint`."""
        if not self.is_deepspeed_enabled:
            yield
            return
        original = transformers.trainer.deepspeed_load_checkpoint

        def load(model: Any, checkpoint: str, *args: Any, **kwargs: Any) -> Any:
            if self._resuming(checkpoint) is None:
                return original(model, checkpoint, *args, **kwargs)
            self._load_from_checkpoint(checkpoint, model)
            return None

        transformers.trainer.deepspeed_load_checkpoint = load
        try:
            yield
        finally:
            transformers.trainer.deepspeed_load_checkpoint = original

    def _read_trainer_state(self, resume: _Resume) -> None:
        """FSDP and DeepSpeed: Trainer reads the TrainerState before it wraps the model, and loads
        the weights after (:meth:`_load_from_checkpoint`). The TrainerState of the
        generation to resume from is written first, and that generation's step
        pinned, so that the weights come from the same one (checked); an allowed
        rollback is applied by this first restore alone."""
        holder: dict[str, Any] = {"trainer_state": {}}
        info = self.checkpoint_manager.restore(
            holder, step=resume.step, allow_rollback_to=resume.allow_rollback_to, strict=False
        )
        if info is None:
            raise NoValidCheckpoint(
                f"{self.checkpoint_manager!r} holds no generation to resume from: train with "
                "resume_from_checkpoint=None to start fresh"
            )
        state = _trainer_state(holder["trainer_state"], info.step)
        state.save_to_json(str(Path(resume.directory) / TRAINER_STATE_FILE))
        resume.step, resume.first = info.step, info

    def _resuming(self, checkpoint: str | None) -> _Resume | None:
        resume = self._ckptvault_resume
        return resume if resume is not None and checkpoint == resume.directory else None

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Where Trainer loads its model: restore (and verify) the whole generation.
        Trainer then reads the TrainerState from the file written here."""
        resume = self._resuming(resume_from_checkpoint)
        if resume is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        sharded = self._engine_state()
        weights: dict[str, Any] = (
            dict(sharded.template())
            if sharded is not None
            else {"model": self.model if model is None else model, "optimizer": {}}
        )
        holder: dict[str, Any] = {
            **weights,
            "scheduler": {},
            "scaler": {},
            "rng": RNGState(),
            "trainer_state": {},
        }
        first = resume.first  # the rollback, if any, is applied once: by the first read
        rollback = resume.allow_rollback_to if first is None else None
        try:
            info = self.checkpoint_manager.restore(
                holder, step=resume.step, allow_rollback_to=rollback
            )
            if info is None:
                raise NoValidCheckpoint(
                    f"{self.checkpoint_manager!r} holds no generation to resume from: train "
                    "with resume_from_checkpoint=None to start fresh"
                )
        except BaseException:
            if sharded is not None:  # the engine's optimizer as it was
                sharded.discard()
            raise
        if first is not None:
            if info.generation_id != first.generation_id:
                raise NoValidCheckpoint(
                    f"the TrainerState was read from generation {first.generation_id} (step "
                    f"{first.step}) and the weights from {info.generation_id}: the store "
                    "changed between the two reads (a save of the same step elsewhere?), "
                    "so this resume stops before training: start it again"
                )
            info = dataclasses.replace(
                info, skipped=first.skipped, rolled_back_from=first.rolled_back_from
            )
        state = _trainer_state(holder["trainer_state"], info.step)
        if sharded is not None:  # the engine built its optimizer already: both load now
            sharded.apply()
        state.save_to_json(str(Path(resume.directory) / TRAINER_STATE_FILE))
        resume.info, self.restore_info = info, info
        resume.optimizer, resume.scheduler = holder["optimizer"], holder["scheduler"]
        resume.scaler = holder["scaler"]
        resume.rng = RNGState().state_dict()  # just set: the saved states, read back
        logger.info("resuming at step %d from generation %s", info.step, info.generation_id)

    def _engine_state(self) -> ShardedState | DeepSpeedState | None:
        """Under DeepSpeed or FSDP, the engine's state as every rank saves its part
        (entries ``model``, ``optimizer`` and, for DeepSpeed, ``deepspeed``)."""
        if self.is_deepspeed_enabled:  # every rank's chunk of ZeRO's state
            return DeepSpeedState(self.model_wrapped)
        if self.is_fsdp_enabled:  # every rank's shards, by parameter name
            optimizer = self.optimizer
            return ShardedState(self.model_wrapped, getattr(optimizer, "optimizer", optimizer))
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        resume = self._resuming(checkpoint)
        if resume is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        if not (self.is_fsdp_enabled or self.is_deepspeed_enabled):  # else with the weights
            _load_into("optimizer", self.optimizer, resume.optimizer)
        _load_into("scheduler", self.lr_scheduler, resume.scheduler)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None and resume.scaler:
            _load_into("scaler", scaler, resume.scaler)
        elif resume.scaler:
            logger.warning("the generation holds a grad scaler's state, this run has no scaler")

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._resuming(checkpoint) is None:
            super()._load_scaler(checkpoint)  # with the optimizer otherwise

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Trainer's RNG sync point: after the first batch of a resumed epoch (its
        loader draws from the global RNGs while it starts), or before the epoch."""
        resume = self._resuming(checkpoint)
        if resume is None:
            super()._load_rng_state(checkpoint)
        elif resume.rng is not None:
            RNGState().load_state_dict(resume.rng)
            resume.rng = None


class _PolicySaves(TrainerCallback):
    """Sets ``control.should_save`` from the manager's save policy after every step,
    in place of ``save_steps`` (the Trainer's save at the end of training stays)."""

    def __init__(self, manager: CheckpointManager) -> None:
        self.manager = manager

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        due = self.manager.should_save(state.global_step)  # every rank, every step
        final = state.global_step >= state.max_steps and control.should_save
        control.should_save = due or final
        return control

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        control.should_save = False  # the epoch's last step had its answer at its end
        return control


def _refuse_unsupported(trainer: Trainer) -> None:
    args = trainer.args
    if getattr(trainer, "is_fsdp_xla_enabled", False):
        raise UsageError(
            "CkptvaultTrainer does not support FSDP on XLA: it saves through its own engine; "
            "train without it, or use Trainer's own checkpoints"
        )
    if args.load_best_model_at_end:
        raise UsageError(
            "CkptvaultTrainer writes no checkpoint-N directories for load_best_model_at_end to "
            "reload: set it to False and restore the best step after training with "
            "checkpoint_manager.restore({'model': model}, step=trainer.state.best_global_step, "
            "strict=False)"
        )
    if args.save_only_model:
        raise UsageError(
            "CkptvaultTrainer saves the whole transition so that a run resumes exactly: set "
            "save_only_model=False (for the weights alone: ckptvault consolidate STORE OUT)"
        )
    if args.save_total_limit is not None:
        logger.warning(
            "save_total_limit is ignored by CkptvaultTrainer: give the CheckpointManager a "
            "retention policy, e.g. retention=cv.Retention(keep_last=%d)",
            args.save_total_limit,
        )


def _record_stateful_callbacks(trainer: Trainer) -> None:
    """What Trainer's own ``_save_checkpoint`` does before writing trainer_state.json:
    the states of callbacks that export one (early stopping, TrainerControl)."""
    # A dict of name -> state (or list of states) once TrainerState is built.
    stored: Any = trainer.state.stateful_callbacks
    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        if not isinstance(callback, ExportableState):
            continue
        name, exported = type(callback).__name__, callback.state()
        if isinstance(stored.get(name), list):
            stored[name].append(exported)
        else:
            stored[name] = exported


def _step_metrics(state: TrainerState) -> dict[str, float] | None:
    """The numbers logged at this step (loss, learning_rate, eval_*), for the manifest."""
    metrics: dict[str, float] = {}
    for entry in state.log_history:
        if entry.get("step") != state.global_step:
            continue
        for name, value in entry.items():
            if (
                name != "step"
                and isinstance(name, str)
                and _METRIC_NAME.match(name)
                and isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
                and abs(value) < 2**63
            ):
                metrics[name] = value
    return metrics or None


def _trainer_state(saved: Mapping[str, Any], step: int) -> TrainerState:
    known = {f.name for f in dataclasses.fields(TrainerState)}
    unknown = sorted(str(key) for key in saved if key not in known)
    if not saved or unknown:
        raise StateMismatchError(
            f"the generation of step {step} holds no TrainerState this transformers version "
            f"reads (fields {unknown[:5]} unknown): resume with the transformers version that "
            "saved it",
            mismatched=["trainer_state"],
        )
    problems = [
        f"{name}={str(saved[name])[:40]!r}"
        for name, kinds in _SCALARS.items()
        if name in saved
        and not (type(saved[name]) in kinds or (None in kinds and saved[name] is None))
    ]
    if saved.get("global_step") != step:  # Trainer resumes at global_step: it must be this one
        problems.append(f"global_step={str(saved.get('global_step'))[:40]!r} (expected {step})")
    if problems:
        raise StateMismatchError(
            f"the TrainerState of the generation of step {step} is malformed: "
            f"{', '.join(problems[:5])}; resume from another step, or fix the store",
            mismatched=["trainer_state"],
        )
    return TrainerState(**saved)


# The scalar fields Trainer computes with, and the types each may hold (JSON numbers).
_SCALARS: dict[str, tuple[Any, ...]] = {
    "global_step": (int,),
    "max_steps": (int,),
    "logging_steps": (int,),
    "eval_steps": (int,),
    "save_steps": (int,),
    "num_train_epochs": (int,),
    "num_input_tokens_seen": (int,),
    "train_batch_size": (int, None),
    "epoch": (int, float, None),
    "total_flos": (int, float),
    "best_metric": (int, float, None),
    "best_global_step": (int, None),
}


def _load_into(name: str, target: Any, state: Mapping[str, Any]) -> None:
    try:
        target.load_state_dict(state)
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise StateMismatchError(
            f"the checkpoint's {name} state does not fit this run's {type(target).__name__} "
            f"({type(exc).__name__}: {str(exc)[:300]}): resume with the optimizer and schedule "
            "the run was saved with",
            mismatched=[name],
        ) from exc
