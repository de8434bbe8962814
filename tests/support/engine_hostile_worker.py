"""One rank of a job that restores hostile engine generations (DeepSpeed ZeRO with
DeepSpeed's CPU accelerator, FSDP2 on gloo), launched by ``multirank.launch``.

``python engine_hostile_worker.py SCENARIO STORE OUT``. Each scenario builds a small
real engine, saves one generation, and then restores copies of it that an attacker
who can write an unsigned store edited (:mod:`support.forging`), each into the same
live engine. Each rank writes ``OUT/rank<r>.json``: per attack, the error raised
(``"ok"`` when none), its message, and whether the live engine and a plain entry
beside it are as they were before. ``deepspeed-module-state`` checks that a generation
holds the module state besides what the optimizer holds (buffers, frozen layers).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import ckptvault as cv
from support.forging import read_logical, write_logical

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed's CPU accelerator, gloo

RANK = int(os.environ.get("RANK", "0"))
Edit = Callable[[dict[str, Any]], None]


# -- editing a generation's state tree (the codec's JSON) ---------------------------


def get(node: dict[str, Any], key: str) -> Any:
    """``node[key]`` of an encoded dict (a JSON object, or ``$dict`` pairs)."""
    if "$dict" not in node:
        return node[key]
    return next(value for name, value in node["$dict"] if name == key)


def put(node: dict[str, Any], key: str, value: Any) -> None:
    if "$dict" not in node:
        node[key] = value
        return
    for pair in node["$dict"]:
        if pair[0] == key:
            pair[1] = value
            return
    node["$dict"].append([key, value])


def forged(original: Path, name: str, edit: Edit) -> Path:
    """A copy of the store at ``original`` whose one generation's state ``edit`` changed
    (rank 0 writes it; every rank restores it)."""
    copied = original.parent / name
    if RANK == 0:
        shutil.copytree(original, copied)
        generation = next(copied.rglob("manifest.json")).parent
        document = read_logical(generation)
        edit(document["state"])
        write_logical(generation, document)
    if dist.is_initialized():
        dist.barrier()
    return copied


# -- DeepSpeed ---------------------------------------------------------------------


def deepspeed_engine(model: torch.nn.Module, stage: int) -> Any:
    import deepspeed

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
    }
    engine, *_ = deepspeed.initialize(
        model=model, config=config, model_parameters=model.parameters()
    )
    return engine


def deepspeed_train(engine: Any, steps: int, seed: int) -> None:
    batches = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=batches)
        engine.backward(engine(x).pow(2).sum())
        engine.step()


def deepspeed_fingerprint(engine: Any) -> str:
    """Every fp32 weight, moment, module weight and buffer, the steps, hyperparameters,
    counters and loss-scaler state of ``engine``, as text."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    parts = []
    for name, param in engine.module.named_parameters():
        full = [safe_get_full_fp32_param(param)]
        full += [safe_get_full_optimizer_state(param, key) for key in ("exp_avg", "exp_avg_sq")]
        with deepspeed.zero.GatheredParameters([param], enabled=hasattr(param, "ds_id")):
            full.append(param.detach().clone())
        parts.append(f"{name}: {[t.tolist() if t is not None else None for t in full]}")
    parts += [f"{name}: {buffer.tolist()}" for name, buffer in engine.module.named_buffers()]
    base = engine.optimizer.optimizer
    parts.append(str([float(state["step"]) for state in base.state.values()]))
    parts.append(str([{k: v for k, v in g.items() if k != "params"} for g in base.param_groups]))
    counters = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
    parts.append(str([getattr(engine, key) for key in counters]))
    parts.append(str(vars(getattr(engine.optimizer, "loss_scaler", None) or object())))
    parts.append(type(engine.optimizer).__name__)
    return "\n".join(parts)


def restore_deepspeed(store: Path, engine: Any, meta: dict[str, Any]) -> str:
    """Restore ``store`` into ``engine`` (and ``meta``) as the integrations do; the
    error raised, or "ok"."""
    from ckptvault.engines.deepspeed import DeepSpeedState

    state = DeepSpeedState(engine)
    try:
        with cv.CheckpointManager(store, run_id="hostile", collective_timeout_s=60) as mgr:
            mgr.restore({**state.template(), "meta": meta})
        state.apply()
    except Exception as exc:
        return f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    return "ok"


def optimizer_edit(edit: Callable[[Any], None]) -> Edit:
    return lambda state: edit(state["optimizer"])


def group_edit(edit: Callable[[Any], None]) -> Edit:
    return optimizer_edit(lambda optimizer: edit(get(optimizer, "param_groups")[0]))


DEEPSPEED_ATTACKS: dict[str, Edit] = {
    # Each key of the counters became an attribute of the engine: engine.optimizer = 0.
    "counter named optimizer": lambda s: put(s["deepspeed"], "optimizer", 0),
    "counter a string": lambda s: put(s["deepspeed"], "global_steps", "abc"),
    "counter huge": lambda s: put(s["deepspeed"], "global_steps", 10**30),
    "counter a float": lambda s: put(s["deepspeed"], "global_steps", 1.5),
    "counters not a dict": lambda s: s.__setitem__("deepspeed", 5),
    "loss scaler a list": lambda s: put(s["deepspeed"], "loss_scaler", [1]),
    "steps strings": optimizer_edit(lambda o: put(o, "steps", ["x"])),
    "steps lists": optimizer_edit(lambda o: put(o, "steps", [[1]])),
    "steps negative": optimizer_edit(lambda o: put(o, "steps", [-1e308])),
    "steps too many": optimizer_edit(lambda o: put(o, "steps", [1.0, 2.0, 3.0])),
    "lr a string": group_edit(lambda g: put(g, "lr", "abc")),
    "betas an int": group_edit(lambda g: put(g, "betas", 5)),
    "betas three": group_edit(lambda g: put(g, "betas", {"$tuple": [0.1, 0.2, 0.3]})),
    "a group too many": optimizer_edit(
        lambda o: get(o, "param_groups").append(copy.deepcopy(get(o, "param_groups")[0]))
    ),
    "groups not a list": optimizer_edit(lambda o: put(o, "param_groups", {"$dict": []})),
    "state of another parameter": optimizer_edit(
        lambda o: put(get(o, "state"), "evil", {"$dict": []})
    ),
    "a moment of its own": optimizer_edit(
        lambda o: put(get(get(o, "state"), "0.weight"), "evil", get(get(o, "state"), "0.bias"))
    ),
    "a weight missing": lambda s: s["model"]["$dict"].pop(0),
}


def deepspeed_forged(store: Path, out: dict[str, Any]) -> None:
    """Every attack of :data:`DEEPSPEED_ATTACKS` against a ZeRO-2 generation."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    engine = deepspeed_engine(model, 2)
    deepspeed_train(engine, 2, 1)
    from ckptvault.engines.deepspeed import DeepSpeedState

    with cv.CheckpointManager(store, run_id="hostile", collective_timeout_s=60) as mgr:
        mgr.save(2, {**DeepSpeedState(engine).capture(), "meta": {"tokens": 7}})
    deepspeed_train(engine, 1, 2)  # the live engine is elsewhere than the generation
    before = deepspeed_fingerprint(engine)
    for name, edit in DEEPSPEED_ATTACKS.items():
        meta = {"tokens": 0}
        error = restore_deepspeed(forged(store, name.replace(" ", "-"), edit), engine, meta)
        out[name] = {
            "error": error,
            "engine untouched": deepspeed_fingerprint(engine) == before,
            "meta untouched": meta == {"tokens": 0},
        }
    meta = {"tokens": 0}
    out["unedited"] = {"error": restore_deepspeed(store, engine, meta), "meta": meta}


def deepspeed_loss_scaler(store: Path, out: dict[str, Any]) -> None:
    """A dynamic loss scaler's state (fp16 engines, which DeepSpeed's CPU accelerator
    does not run: a bf16 ZeRO-1 engine is given DeepSpeed's own DynamicLossScaler)
    saved and restored."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from ckptvault.engines.deepspeed import DeepSpeedState

    def engine_with_scaler(scale: float) -> Any:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 4))
        engine = deepspeed_engine(model, 1)
        engine.optimizer.loss_scaler = DynamicLossScaler(scale, 10, 1, 2, False)
        return engine

    saved = engine_with_scaler(2.0**12)
    deepspeed_train(saved, 1, 1)
    saved.optimizer.loss_scaler.cur_iter, saved.optimizer.loss_scaler.cur_hysteresis = 7, 1
    with cv.CheckpointManager(store, run_id="hostile", collective_timeout_s=60) as mgr:
        mgr.save(1, {**DeepSpeedState(saved).capture(), "meta": {}})
    engine = engine_with_scaler(1.0)
    deepspeed_train(engine, 1, 1)
    out["error"] = restore_deepspeed(store, engine, {})
    scaler = engine.optimizer.loss_scaler
    out["scaler"] = [scaler.cur_scale, scaler.cur_iter, scaler.cur_hysteresis]
    out["same"] = deepspeed_fingerprint(engine) == deepspeed_fingerprint(saved)


def deepspeed_module_state(store: Path, out: dict[str, Any]) -> None:
    """A module with state its optimizer does not hold: BatchNorm's buffers (each rank
    its own running statistics, from its own batches) and a frozen layer set after
    it was built (as a pretrained load would), under ZeRO-1 and ZeRO-3, saved and
    restored into an engine built from another seed. Reports, per stage, the buffers
    and frozen weight rank 0 held at the save and those each rank holds restored."""
    import deepspeed

    from ckptvault.engines.deepspeed import DeepSpeedState

    def build(seed: int, stage: int) -> Any:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(
            torch.nn.Linear(8, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 3)
        )
        model[2].requires_grad_(False)
        if seed == 0:
            with torch.no_grad():
                model[2].weight.copy_(torch.arange(15.0).reshape(3, 5))
        return deepspeed_engine(model, stage)

    def module_state(engine: Any) -> dict[str, Any]:
        frozen = engine.module[2].weight
        with deepspeed.zero.GatheredParameters([frozen], enabled=hasattr(frozen, "ds_id")):
            weight = frozen.detach().tolist()
        buffers = {name: b.tolist() for name, b in engine.module.named_buffers()}
        return {"frozen": weight, **buffers}

    for stage in (1, 3):
        saved = build(0, stage)
        deepspeed_train(saved, 2, 10 + RANK)  # each rank its own batches
        path = store / f"zero{stage}"
        with cv.CheckpointManager(path, run_id="hostile", collective_timeout_s=60) as mgr:
            mgr.save(2, {**DeepSpeedState(saved).capture(), "meta": {}})
        at_save = module_state(saved)
        engine = build(1, stage)
        error = restore_deepspeed(path, engine, {})
        out[f"zero{stage}"] = {"error": error, "saved": at_save, "restored": module_state(engine)}


# -- FSDP2 ------------------------------------------------------------------------


def fsdp_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def fsdp_train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    batches = torch.Generator().manual_seed(seed)
    model(torch.randn(4, 8, generator=batches)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def fsdp_fingerprint(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    whole = StateDictOptions(full_state_dict=True)
    return repr(
        (
            get_model_state_dict(model, options=whole),
            get_optimizer_state_dict(model, optimizer, options=whole),
        )
    )


def restore_fsdp(store: Path, model: Any, optimizer: Any, meta: dict[str, Any]) -> str:
    """Restore ``store`` into the FSDP2 ``model`` and ``optimizer`` (and ``meta``) as
    the integrations do; the error raised, or "ok"."""
    from ckptvault.engines.fsdp import ShardedState

    state = ShardedState(model, optimizer)
    try:
        with cv.CheckpointManager(store, run_id="hostile", collective_timeout_s=60) as mgr:
            mgr.restore({**state.template(), "meta": meta})
        state.apply()
    except Exception as exc:
        return f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    return "ok"


def state_edit(edit: Callable[[Any], None]) -> Edit:
    return optimizer_edit(lambda o: edit(get(get(o, "state"), "0.weight")))


FSDP_ATTACKS: dict[str, Edit] = {
    "lr a string": group_edit(lambda g: put(g, "lr", "abc")),
    "betas an int": group_edit(lambda g: put(g, "betas", 5)),
    "no params": group_edit(lambda g: g["$dict"].remove(["params", get(g, "params")])),
    "params of one": group_edit(lambda g: put(g, "params", ["0.weight"])),
    "params renamed": group_edit(lambda g: put(g, "params", ["x", "0.bias", "2.weight", "2.bias"])),
    "a group too many": DEEPSPEED_ATTACKS["a group too many"],
    "groups not a list": DEEPSPEED_ATTACKS["groups not a list"],
    # A string replaced the live step tensor: the optimizer held "x" afterwards.
    "step a string": state_edit(lambda entry: put(entry, "step", "x")),
    "a moment a number": state_edit(lambda entry: put(entry, "exp_avg", 1.0)),
    "a weight a number": lambda s: put(s["model"], "0.weight", 3),
}


def fsdp_forged(store: Path, out: dict[str, Any]) -> None:
    """Every attack of :data:`FSDP_ATTACKS` against an FSDP2 generation, and the
    generations of the other engine: FSDP2's restored by DeepSpeed, DeepSpeed's by
    FSDP2."""
    from ckptvault.engines.deepspeed import DeepSpeedState
    from ckptvault.engines.fsdp import ShardedState

    model, optimizer = fsdp_model()
    fsdp_train(model, optimizer, 1)
    with cv.CheckpointManager(store, run_id="hostile", collective_timeout_s=60) as mgr:
        mgr.save(1, {**ShardedState(model, optimizer).capture(), "meta": {"tokens": 7}})
    fsdp_train(model, optimizer, 2)
    before = fsdp_fingerprint(model, optimizer)
    for name, edit in FSDP_ATTACKS.items():
        meta = {"tokens": 0}
        error = restore_fsdp(forged(store, name.replace(" ", "-"), edit), model, optimizer, meta)
        untouched = fsdp_fingerprint(model, optimizer) == before and meta == {"tokens": 0}
        out[name] = {"error": error, "untouched": untouched}

    torch.manual_seed(0)  # the same parameter names and shapes, under DeepSpeed
    sequential = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)
    )
    engine = deepspeed_engine(sequential, 2)
    deepspeed_train(engine, 1, 3)
    deepspeed_before = deepspeed_fingerprint(engine)
    meta = {"tokens": 0}
    error = restore_deepspeed(store, engine, meta)
    untouched = deepspeed_fingerprint(engine) == deepspeed_before and meta == {"tokens": 0}
    out["fsdp into deepspeed"] = {"error": error, "untouched": untouched}
    deepspeed_store = store.parent / "deepspeed"
    with cv.CheckpointManager(deepspeed_store, run_id="hostile", collective_timeout_s=60) as mgr:
        mgr.save(1, {**DeepSpeedState(engine).capture(), "meta": {"tokens": 7}})
    error = restore_fsdp(deepspeed_store, model, optimizer, meta)
    untouched = fsdp_fingerprint(model, optimizer) == before and meta == {"tokens": 0}
    out["deepspeed into fsdp"] = {"error": error, "untouched": untouched}
    out["unedited"] = {"error": restore_fsdp(store, model, optimizer, meta), "meta": meta}


# -- the Hugging Face Trainer under DeepSpeed ---------------------------------------


def trainer_rollback(store: Path, out: dict[str, Any]) -> None:
    """``CkptvaultTrainer`` under DeepSpeed ZeRO-1, with a ledger: saves at steps 2
    and 4, then a new Trainer resumes with ``allow_rollback_to=2``. Under an engine the
    Trainer reads the TrainerState and the weights in two restores; reports the
    ``restore_info`` the resume gives and the audit log's entries."""
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from ckptvault.integrations.huggingface import CkptvaultTrainer
    from support.engine_worker import _trainer_engine

    settings = _trainer_engine("zero1")
    tokens = torch.randint(0, 32, (16, 8), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    control = store.parent / "control"
    options = {"ledger": str(control / "ledger"), "audit_log": str(control / "audit.jsonl")}

    def trainer(manager: Any, save: bool) -> Any:
        torch.manual_seed(0)
        config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=32, n_positions=8)
        args = TrainingArguments(
            str(store.parent / "out"),
            max_steps=4,
            save_strategy="steps" if save else "no",
            save_steps=2,
            per_device_train_batch_size=2,
            report_to="none",
            disable_tqdm=True,
            **settings,
        )
        model = GPT2LMHeadModel(config)
        return CkptvaultTrainer(
            model=model, args=args, train_dataset=data, checkpoint_manager=manager
        )

    with cv.CheckpointManager(store, run_id="hostile", **options) as manager:
        trainer(manager, True).train()
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state()  # a second Trainer's Accelerator takes its plugin
    with cv.CheckpointManager(store, run_id="hostile", **options) as manager:
        resumed = trainer(manager, False)
        resumed.train(resume_from_checkpoint=True, allow_rollback_to=2)
    info = resumed.restore_info
    out["info"] = [info.step, info.rolled_back_from]
    audit = (control / "audit.jsonl").read_text().splitlines()
    out["audit"] = [json.loads(line).get("event") for line in audit]


# -- a restore that finds nothing ----------------------------------------------------


def empty_store(store: Path, out: dict[str, Any]) -> None:
    """Accelerate under DeepSpeed ZeRO-2, and ShardedState over FSDP2: a fresh run
    that calls ``load_state()`` on an empty store (None: nothing changed) must then
    train exactly as one that never called it. Reports whether each did."""
    from accelerate.state import AcceleratorState

    from ckptvault.engines.fsdp import ShardedState
    from ckptvault.integrations.accelerate import Checkpointer
    from support.engine_worker import _accelerator, _model

    def accelerate_run(load: bool) -> tuple[Any, dict[str, str]]:
        AcceleratorState._reset_state()
        accelerator = _accelerator("zero2")
        model = _model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        loader = torch.utils.data.DataLoader(torch.zeros(8, 8), batch_size=4)
        model, optimizer, _ = accelerator.prepare(model, optimizer, loader)
        info = None
        if load:
            with cv.CheckpointManager(store, run_id="hostile") as mgr:
                info = Checkpointer(accelerator, mgr).load_state()
        torch.manual_seed(5)  # the same dropout masks
        deepspeed_train(model, 3, 1)
        return info, {"state": deepspeed_fingerprint(model)}

    _, fresh = accelerate_run(False)
    info, loaded = accelerate_run(True)
    out["accelerate"] = {"info": info, "same": loaded == fresh}

    def fsdp_run(load: bool) -> str:
        model, optimizer = fsdp_model()
        if load:
            sharded = ShardedState(model, optimizer)
            with cv.CheckpointManager(store.parent / "fsdp", run_id="hostile") as mgr:
                assert mgr.restore(sharded.template()) is None
            sharded.discard()
        for seed in range(3):
            fsdp_train(model, optimizer, seed)
        return fsdp_fingerprint(model, optimizer)

    out["fsdp"] = {"same": fsdp_run(True) == fsdp_run(False)}


# -- Lightning's ModelParallelStrategy (FSDP2) --------------------------------------


def lightning_forged(store: Path, out: dict[str, Any]) -> None:
    """A one-rank FSDP2 fit through ``CkptvaultModelParallelStrategy`` saves at step
    2; fits resumed from edited copies of its generation must be refused before the
    module's weights (the templates' tensors are its own) or optimizer change."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ckptvault.integrations.lightning import CkptvaultCheckpointIO
    from ckptvault.integrations.lightning_strategies import CkptvaultModelParallelStrategy
    from support.lightning_worker import Regression, hexed

    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    ckpt = store.parent / "ckpt"

    def fit(module: Any, path: Path, resume: bool) -> None:
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=4 if resume else 2,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            strategy=CkptvaultModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1),
            plugins=[CkptvaultCheckpointIO(str(path), run_id="hostile")],
            callbacks=[ModelCheckpoint(dirpath=str(ckpt), save_last=True, every_n_train_steps=2)],
        )
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        trainer.fit(module, loader, ckpt_path=str(ckpt / "last.ckpt") if resume else None)

    torch.manual_seed(0)
    fit(Regression(True), store, False)
    attacks: dict[str, Edit] = {
        "lr a string": lambda s: put(
            get(get(s["lightning"], "optimizer_states")[0], "param_groups")[0], "lr", "abc"
        ),
        "an optimizer too many": lambda s: get(s["lightning"], "optimizer_states").append(
            copy.deepcopy(get(s["lightning"], "optimizer_states")[0])
        ),
    }
    for name, edit in attacks.items():
        torch.manual_seed(0)
        module = Regression(True)
        initial = {key: hexed(value) for key, value in module.net.state_dict().items()}
        try:
            fit(module, forged(store, name.replace(" ", "-"), edit), True)
            error = "ok"
        except Exception as exc:
            error = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
        weights = {key: hexed(value) for key, value in module.net.state_dict().items()}
        # (The optimizer got its first state from DCP when the template was made: the
        # fit stops here, so that is left alone.)
        out[name] = {"error": error, "untouched": weights == initial}


SCENARIOS: dict[str, Callable[[Path, dict[str, Any]], None]] = {
    "deepspeed-forged": deepspeed_forged,
    "deepspeed-loss-scaler": deepspeed_loss_scaler,
    "fsdp-forged": fsdp_forged,
    "deepspeed-module-state": deepspeed_module_state,
    "trainer-rollback": trainer_rollback,
    "empty-store": empty_store,
    "lightning-forged": lightning_forged,
}


def main() -> None:
    scenario, store, out_dir = sys.argv[1:4]
    out: dict[str, Any] = {"rank": RANK}
    try:
        import deepspeed
        import deepspeed.ops

        # No shared-memory allreduce op to compile: nothing a checkpoint uses.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        if scenario not in ("trainer-rollback", "empty-store", "lightning-forged"):  # their own
            deepspeed.init_distributed("gloo")
        SCENARIOS[scenario](Path(store), out)
    finally:
        Path(out_dir, f"rank{RANK}.json").write_text(json.dumps(out))
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
