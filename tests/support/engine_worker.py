"""One rank of a training job under an engine (FSDP1, FSDP2, DeepSpeed ZeRO 1-3)
through an integration (Accelerate, Hugging Face Trainer, or DeepSpeed alone),
launched by ``multirank.launch``.

``python engine_worker.py SCENARIO STORE OUT``; SCENARIO is
``INTEGRATION:ENGINE:MODE`` (``accelerate:fsdp2:reference``, ``trainer:zero3:resume``):
MODE ``reference`` saves at step ``SAVE_AT`` only, trains to ``STEPS``, reports and is
SIGKILLed (its store is one a killed run left); ``resume`` restores the newest
generation and trains to ``STEPS``, saving nothing. Each rank writes
``OUT/rank<r>.json``: digests of the whole weights and optimizer state at the save
(``saved``; ``restored`` right after a resume) and at the end (``final``).

Accelerate turns FSDP on only for accelerator devices (``AcceleratorState`` keeps
``MULTI_CPU`` for ``cpu=True``). :func:`fsdp_on_cpu` sets the distributed type to
FSDP with the plugin the caller gave, after Accelerate's own set-up, so that FSDP's
preparation, the Trainer's FSDP branches and torch's FSDP run for real on CPU ranks
over gloo; on a GPU nothing here is needed.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ckptvault as cv

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator, gloo

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
SAVE_AT, STEPS = 5, 8
SEED = 0


def fsdp_on_cpu() -> None:
    """Let ``Accelerator(cpu=True, fsdp_plugin=...)`` run FSDP (see the module docstring)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = Accelerator.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        state = AcceleratorState()
        if plugin is not None and state.distributed_type == DistributedType.MULTI_CPU:
            state.fsdp_plugin = plugin
            # As AcceleratorState does for the devices it runs FSDP on: every later
            # AcceleratorState() takes these from PartialState's shared state.
            for shared in (state.__dict__, PartialState._shared_state):
                shared["distributed_type"] = DistributedType.FSDP
                shared["device"] = torch.device("cpu")

    Accelerator.__init__ = init  # type: ignore[method-assign]


def digests(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, str]:
    """SHA-256 of every whole weight and optimizer state tensor, by name."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    whole = StateDictOptions(full_state_dict=True)
    state = {
        "model": get_model_state_dict(model, options=whole),
        "optim": get_optimizer_state_dict(model, optimizer, options=whole)["state"],
    }
    out: dict[str, str] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            out[path] = hashlib.sha256(data).hexdigest()
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{path}/{key}")

    walk(state, "")
    return out


def _model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )


def readme_engines(heading: str, **stubs: Any) -> dict[str, Any]:
    """The documented engine settings under ``heading``: its ``fsdp(version,
    state_dict_type)`` and ``zero(stage)``, the block run as written (``stubs``: the
    names whose calls the worker makes itself)."""
    from support.readme_runs import readme_block

    namespace: dict[str, Any] = {"__name__": "readme", **stubs}
    exec(readme_block(heading), namespace)
    return namespace


def engine_settings(namespace: dict[str, Any], engine: str) -> dict[str, Any]:
    """``engine`` (``fsdp2``, ``fsdp1-FULL_STATE_DICT``, ``zero3``) through the docs'
    own ``fsdp``/``zero``."""
    if engine.startswith("zero"):
        return dict(namespace["zero"](int(engine.removeprefix("zero"))))
    version, _, state_dict_type = engine.removeprefix("fsdp").partition("-")
    return dict(namespace["fsdp"](int(version), state_dict_type or "SHARDED_STATE_DICT"))


def _accelerator(engine: str) -> Any:
    """An Accelerator running ``engine`` on this job's CPU ranks, set up as the
    docs' "Accelerate with FSDP or DeepSpeed" says."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import InitProcessGroupKwargs

    readme = readme_engines(
        "#### Accelerate with FSDP or DeepSpeed",
        Accelerator=lambda **kwargs: None,
        DataLoaderConfiguration=DataLoaderConfiguration,
    )
    settings = engine_settings(readme, engine)
    loaders = DataLoaderConfiguration(use_seedable_sampler=True)
    if engine.startswith("zero"):
        deepspeed_on_cpu()
        # Accelerate finds no accelerator device to take a backend from: gloo.
        gloo = [InitProcessGroupKwargs(backend="gloo")]
        return Accelerator(dataloader_config=loaders, kwargs_handlers=gloo, **settings)
    fsdp_on_cpu()
    return Accelerator(cpu=True, dataloader_config=loaders, **settings)


def accelerate_run(engine: str, mode: str, store: str, out: dict[str, Any]) -> None:
    from accelerate.utils import set_seed

    from ckptvault.integrations.accelerate import Checkpointer

    set_seed(SEED)
    accelerator = _accelerator(engine)
    model = _model()
    flattens = engine.startswith("fsdp1")
    if flattens:  # FSDP1 flattens the parameters: the optimizer takes the prepared ones
        model = accelerator.prepare(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 8, generator=torch.Generator().manual_seed(1)),
        torch.randn(48, 4, generator=torch.Generator().manual_seed(2)),
    )
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.7)
    prepared = accelerator.prepare(*([] if flattens else [model]), optimizer, loader, scheduler)
    model = model if flattens else prepared[0]
    optimizer, loader, scheduler = prepared[-3:]

    def state() -> dict[str, str]:
        if engine.startswith("zero"):
            return ds_digests(model)
        return digests(model, optimizer)

    out["engine"] = str(accelerator.distributed_type)
    with cv.CheckpointManager(store, run_id="engine", collective_timeout_s=60) as mgr:
        ckpt = Checkpointer(accelerator, mgr)
        step = 0
        if mode == "resume":
            info = ckpt.load_state()
            assert info is not None
            step = info.step
            out["restored"] = state()
        for epoch in range(step // len(loader), STEPS // len(loader) + 1):
            for x, y in ckpt.skip_first_batches(loader, step - epoch * len(loader)):
                if step == STEPS:
                    break
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                step += 1
                if step == SAVE_AT and mode != "resume":
                    ckpt.save_state(step, blocking=True)
                    out["saved"] = state()
    out["final"] = state()
    out["step"] = step


def _trainer_engine(engine: str) -> dict[str, Any]:
    """TrainingArguments for ``engine`` on this job's CPU ranks: the docs' "Trainer
    with FSDP or DeepSpeed" settings, and what a CPU needs besides."""
    readme = readme_engines(
        "#### Trainer with FSDP or DeepSpeed", TrainingArguments=lambda *args, **kwargs: None
    )
    settings = engine_settings(readme, engine)
    if engine.startswith("zero"):
        deepspeed_on_cpu()
        # Under DeepSpeed Trainer hands Accelerate no backend (it takes the device's;
        # a CPU has none): Accelerate's process state is set up with gloo first, and
        # Trainer told to use it (Trainer's own option for a configured state).
        from accelerate.state import PartialState

        os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
        PartialState(backend="gloo")
        return {**settings, "accelerator_config": {"use_configured_state": True}}
    fsdp_on_cpu()
    # Accelerate refuses FSDP1's sync_module_states on CPU (every rank builds the same
    # model from the same seed here anyway).
    settings["fsdp_config"] = {**settings["fsdp_config"], "sync_module_states": False}
    return {**settings, "use_cpu": True}


def trainer_run(engine: str, mode: str, store: str, out: dict[str, Any]) -> None:
    """A tiny GPT-2 under ``CkptvaultTrainer`` with FSDP or DeepSpeed."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments
    from transformers import set_seed as hf_set_seed

    from ckptvault.integrations.huggingface import CkptvaultTrainer

    def state() -> dict[str, str]:
        if engine.startswith("zero"):
            return ds_digests(trainer.model_wrapped)
        return digests(trainer.model_wrapped, trainer.optimizer.optimizer)

    class Recorder(TrainerCallback):
        def on_step_end(self, args: Any, state_: Any, control: Any, **kwargs: Any) -> None:
            if state_.global_step != SAVE_AT:  # Trainer also saves at its last step
                control.should_save = False

        def on_save(self, args: Any, state_: Any, control: Any, **kwargs: Any) -> None:
            if state_.global_step == SAVE_AT and mode != "resume":
                out["saved"] = state()

    hf_set_seed(SEED)
    config = GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8)
    model = GPT2LMHeadModel(config)  # dropout on: the RNGs matter
    tokens = torch.randint(0, 32, (24, 8), generator=torch.Generator().manual_seed(1))
    engine_args = _trainer_engine(engine)
    args = TrainingArguments(
        str(Path(store).parent / f"out-{RANK}"),
        max_steps=STEPS,
        # A resume saves nothing: later restores of the store see step 3 as the newest.
        save_strategy="no" if mode == "resume" else "steps",
        save_steps=SAVE_AT,
        logging_steps=1,
        per_device_train_batch_size=2,
        report_to="none",
        disable_tqdm=True,
        **engine_args,
    )
    with cv.CheckpointManager(store, run_id="engine", collective_timeout_s=60) as manager:
        trainer = CkptvaultTrainer(
            model=model,
            args=args,
            train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
            checkpoint_manager=manager,
            callbacks=[Recorder()],
        )
        if mode == "resume":
            original = trainer._load_optimizer_and_scheduler

            def loaded(checkpoint: Any) -> None:  # the moment the generation is in place
                original(checkpoint)
                out["restored"] = state()

            trainer._load_optimizer_and_scheduler = loaded  # type: ignore[method-assign]
        trainer.train(resume_from_checkpoint=mode == "resume" or None)
    out["engine"] = (
        "deepspeed"
        if trainer.is_deepspeed_enabled
        else "fsdp"
        if trainer.is_fsdp_enabled
        else "none"
    )
    out["final"] = state()
    out["step"] = trainer.state.global_step
    out["losses"] = [e["loss"] for e in trainer.state.log_history if "loss" in e]


def ds_digests(engine: Any) -> dict[str, str]:
    """SHA-256 of every whole fp32 weight, optimizer state tensor and module weight
    of a DeepSpeed engine, by name."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    out: dict[str, str] = {}
    for name, param in engine.module.named_parameters():
        tensors = {
            "fp32": safe_get_full_fp32_param(param),
            "exp_avg": safe_get_full_optimizer_state(param, "exp_avg"),
            "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq"),
        }
        with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            tensors["module"] = param.detach().clone()
        for key, tensor in tensors.items():
            data = tensor.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy()
            out[f"{name}/{key}"] = hashlib.sha256(data.tobytes()).hexdigest()
    base = engine.optimizer.optimizer
    out["steps"] = str([float(s["step"]) for s in base.state.values()])
    out["counters"] = str([engine.global_steps, engine.global_samples, engine.micro_steps])
    return out


def deepspeed_on_cpu() -> None:
    """DeepSpeed on CPU ranks without compiling its shared-memory allreduce op (22 s
    of C++ on a fresh machine; nothing a checkpoint uses)."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def deepspeed_run(engine_name: str, mode: str, store: str, out: dict[str, Any]) -> None:
    """A DeepSpeed engine (``zero1``, ``zero2``, ``zero3``) built with
    ``deepspeed.initialize``, saved through :class:`DeepSpeedState`; ``reference``
    (see the module docstring for the modes)."""
    import deepspeed

    from ckptvault.engines.deepspeed import DeepSpeedState

    deepspeed_on_cpu()
    deepspeed.init_distributed("gloo")
    stage = int(engine_name.removeprefix("zero"))
    torch.manual_seed(SEED)
    model = _model()
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 1e-2, "weight_decay": 0.1, "torch_adam": True},
        },
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = deepspeed.initialize(
        model=model, config=config, model_parameters=model.parameters()
    )
    torch.manual_seed(100 + RANK)  # each rank's own dropout stream
    with cv.CheckpointManager(store, run_id="engine", collective_timeout_s=60) as mgr:
        step = 0
        if mode == "resume":
            state = DeepSpeedState(engine)
            holder = {**state.template(), "rng": cv.RNGState()}
            info = mgr.restore(holder)
            assert info is not None
            state.apply()
            step = info.step
            out["restored"] = ds_digests(engine)
        while step < STEPS:
            batch = torch.Generator().manual_seed(1000 * step + RANK)
            x, y = torch.randn(4, 8, generator=batch), torch.randn(4, 4, generator=batch)
            loss = torch.nn.functional.mse_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            step += 1
            if step == SAVE_AT and mode != "resume":
                mgr.save(step, {**DeepSpeedState(engine).capture(), "rng": cv.RNGState()})
                mgr.wait()
                out["saved"] = ds_digests(engine)
    out["final"] = ds_digests(engine)
    out["step"] = step
    out["engine"] = f"zero{engine.zero_optimization_stage()}"


SCENARIOS = {"accelerate": accelerate_run, "trainer": trainer_run, "deepspeed": deepspeed_run}
OUT_DIR = Path()


def _report(out: dict[str, Any]) -> None:
    Path(OUT_DIR, f"rank{RANK}.json").write_text(json.dumps(out))


def main() -> None:
    global OUT_DIR
    scenario, store, out_dir = sys.argv[1:4]
    OUT_DIR = Path(out_dir)
    integration, engine, mode = scenario.split(":")
    out: dict[str, Any] = {"rank": RANK, "world": WORLD}
    try:
        SCENARIOS[integration](engine, mode, store, out)
        if mode == "reference":  # its store is one a SIGKILLed run left behind
            _report(out)
            os.kill(os.getpid(), signal.SIGKILL)
    finally:
        _report(out)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
