"""Restoring into live objects whose names or dtypes differ from the checkpoint's:
torch.compile's ``_orig_mod.`` prefix, renamed modules, ``strict=False`` that must
never half-restore, and one dtype rule for modules and plain tensors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptvault as cv
from ckptvault.errors import StateMismatchError, UsageError
from ckptvault.ops.export import export_weights
from ckptvault.state.apply import plan_restore
from ckptvault.state.capture import StatefulPayload
from ckptvault.state.names import ApplyOptions, plain_name


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.encoder(x)))


class RenamedNet(torch.nn.Module):
    """Net after a refactor: ``encoder`` became ``body``."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 2)


def trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(16, 4)).square().mean().backward()
    opt.step()
    return model, opt


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {plain_name(k): v.detach().clone() for k, v in model.state_dict().items()}


def save(store: Path, state: dict) -> None:
    with cv.CheckpointManager(store, run_id="names") as mgr:
        mgr.save(1, state)


def restore(store: Path, state: dict, **kwargs) -> cv.RestoreInfo:
    with cv.CheckpointManager(store, run_id="names") as mgr:
        info = mgr.restore(state, **kwargs)
    assert info is not None
    return info


def test_plain_names_drop_only_whole_orig_mod_segments():
    assert plain_name("_orig_mod.fc.weight") == "fc.weight"
    assert plain_name("block._orig_mod.fc.weight") == "block.fc.weight"
    assert plain_name("my_orig_mod.weight") == "my_orig_mod.weight"


def test_a_compiled_models_checkpoint_restores_into_a_plain_model_and_back(store: Path):
    model, opt = trained(0)
    compiled = torch.compile(model)
    save(store, {"model": compiled, "optimizer": opt})
    plain, plain_opt = trained(1)
    info = restore(store, {"model": plain, "optimizer": plain_opt})
    assert weights(plain).keys() == weights(model).keys()
    for key, value in weights(model).items():
        assert torch.equal(weights(plain)[key], value), key
    assert info.loaded[0] == "state['model'] (9 of 9 keys)"
    assert "state['optimizer']" in info.loaded
    assert not (info.missing or info.unexpected or info.mismatched or info.casts)

    # ...and a plain model's checkpoint into a compiled one.
    back_store = store.parent / "back"
    save(back_store, {"model": plain})
    target, _ = trained(2)
    compiled_target = torch.compile(target)
    restore(back_store, {"model": compiled_target})
    for key, value in weights(model).items():
        assert torch.equal(weights(compiled_target)[key], value), key


def test_a_compiled_submodule_interchanges_too(store: Path):
    model, _ = trained(0)
    model.encoder = torch.compile(model.encoder)  # keys encoder._orig_mod.weight
    assert "encoder._orig_mod.weight" in model.state_dict()
    save(store, {"model": model})
    plain, _ = trained(1)
    restore(store, {"model": plain})
    assert torch.equal(plain.encoder.weight, model.encoder.weight)


def test_checkpoints_written_with_orig_mod_names_still_restore():
    """Generations saved before names were normalized hold ``_orig_mod.`` keys."""
    model, _ = trained(0)
    old_state = {f"_orig_mod.{k}": v.clone() for k, v in model.state_dict().items()}
    saved = {"model": StatefulPayload("module", "OptimizedModule", old_state, None)}
    plain, _ = trained(1)
    plan = plan_restore({"model": plain}, saved)
    assert plan.clean and not plan.refused
    plan.apply()
    assert torch.equal(plain.head.weight, model.head.weight)


def test_export_of_a_compiled_model_writes_plain_names(store: Path, tmp_path: Path):
    model, _ = trained(0)
    save(store, {"model": torch.compile(model)})
    out = tmp_path / "model.safetensors"
    export_weights(store, 1, out)
    exported = load_file(out)
    assert set(exported) == set(model.state_dict())
    assert torch.equal(exported["head.weight"], model.head.weight.detach())


def test_strict_false_never_half_restores_a_model_none_of_whose_keys_match(store: Path):
    model, opt = trained(0)
    save(store, {"model": model, "optimizer": opt})
    wrapped, wrapped_opt = trained(1)
    outer = torch.nn.Sequential(wrapped)  # keys 0.encoder.weight: nothing matches
    before = {k: v.clone() for k, v in outer.state_dict().items()}
    opt_before = wrapped_opt.state_dict()["state"][0]["exp_avg"].clone()
    with pytest.raises(StateMismatchError, match="none of the checkpoint's") as raised:
        restore(store, {"model": outer, "optimizer": wrapped_opt}, strict=False)
    assert "rename=" in str(raised.value)
    for key, value in outer.state_dict().items():  # nothing at all was applied
        assert torch.equal(value, before[key]), key
    assert torch.equal(wrapped_opt.state_dict()["state"][0]["exp_avg"], opt_before)


def test_strict_false_reports_what_it_loaded_and_skipped(store: Path):
    model, _ = trained(0)
    save(store, {"model": model})
    target, _ = trained(1)
    target.head = torch.nn.Linear(8, 3)  # a new head: mis-shaped
    info = restore(store, {"model": target}, strict=False)
    assert sorted(info.mismatched) == [
        "state['model']['head.bias']: checkpoint [2], model [3]",
        "state['model']['head.weight']: checkpoint [2, 8], model [3, 8]",
    ]
    assert info.loaded == ["state['model'] (7 of 9 keys)"]
    assert torch.equal(target.encoder.weight, model.encoder.weight)


def test_renamed_modules_restore_with_a_prefix_map_or_a_callable(store: Path):
    model, _ = trained(0)
    save(store, {"model": model})
    target = RenamedNet()
    with pytest.raises(StateMismatchError, match=r"encoder\.weight"):  # without the map
        restore(store, {"model": target})
    info = restore(store, {"model": target}, rename={"encoder.": "body."})
    assert torch.equal(target.body.weight, model.encoder.weight)
    assert sorted(info.renamed) == [
        "state['model']['encoder.bias'] -> body.bias",
        "state['model']['encoder.weight'] -> body.weight",
    ]
    other = RenamedNet()
    restore(store, {"model": other}, rename=lambda name: name.replace("encoder", "body"))
    assert torch.equal(other.body.bias, model.encoder.bias)


@pytest.mark.parametrize("rename", [{"": "x."}, {"a.": 3}, ["encoder.", "body."]])
def test_a_malformed_rename_is_a_usage_error(rename):
    with pytest.raises(UsageError, match="rename="):
        ApplyOptions(rename=rename)


def test_a_rename_callable_must_return_a_name(store: Path):
    model, _ = trained(0)
    save(store, {"model": model})
    with pytest.raises(UsageError, match="must return the live name"):
        restore(store, {"model": RenamedNet()}, rename=lambda name: None)


def test_one_dtype_rule_casts_modules_and_tensors_and_lists_every_cast(store: Path):
    model, _ = trained(0)
    model.to(torch.bfloat16)
    save(store, {"model": model, "ema": torch.ones(3, dtype=torch.bfloat16)})
    target, _ = trained(1)
    ema = torch.zeros(3)
    state = {"model": target, "ema": ema}
    info = restore(store, state)
    assert state["ema"] is ema and torch.equal(ema, torch.ones(3))
    assert "state['ema']: torch.bfloat16 -> torch.float32" in info.casts
    assert "state['model']['head.weight']: torch.bfloat16 -> torch.float32" in info.casts
    assert torch.equal(target.head.weight, model.head.weight.float())
    assert target.head.weight.dtype == torch.float32


def test_strict_dtypes_refuses_every_cast_and_touches_nothing(store: Path):
    model, _ = trained(0)
    model.to(torch.bfloat16)
    save(store, {"model": model, "ema": torch.ones(3, dtype=torch.bfloat16)})
    target, _ = trained(1)
    before = target.head.weight.detach().clone()
    ema = torch.zeros(3)
    with pytest.raises(StateMismatchError, match="strict_dtypes") as raised:
        restore(store, {"model": target, "ema": ema}, strict_dtypes=True)
    assert any(m.startswith("state['ema']: torch.bfloat16") for m in raised.value.mismatched)
    assert torch.equal(target.head.weight, before) and torch.equal(ema, torch.zeros(3))


def test_an_export_of_a_compiled_transformer_loads_with_from_pretrained(store, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    save(store, {"model": torch.compile(model)})
    out = tmp_path / "hf"
    out.mkdir()
    config.save_pretrained(out)
    export_weights(store, 1, out / "model.safetensors")
    loaded, report = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not report["missing_keys"] and not report["unexpected_keys"]
    tokens = torch.arange(10)[None]
    with torch.no_grad():
        assert torch.equal(model.eval()(tokens).logits, loaded.eval()(tokens).logits)
