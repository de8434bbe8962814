"""Hostile state, planning (see ``test_hostile_state``): planted state trees that
would make applying go wrong are refused while planning, before anything is applied,
and the caller's objects never gain attributes or lose their methods.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import (
    CheckpointError,
    ContractMismatch,
    FormatError,
    StateMismatchError,
)
from ckptvault.state.apply import plan_restore
from ckptvault.state.contract import compare_contracts
from ckptvault.storage.posix.store import PosixStore
from support.common import (
    make_training_state,
    train_steps,
)
from support.hostile_forging import forge_manifest
from support.hostile_inputs import save_two_steps
from support.hostile_state import (
    assert_refused_untouched,
    assert_scheduler_intact,
    restore_into,
    set_pair,
    tree,
)


@pytest.fixture
def two_steps(store: Path) -> tuple[dict[int, Path], dict[int, dict]]:
    """Steps 1 and 2 of an unsigned run (format 3); the attacks target step 2."""
    return save_two_steps(store)


# -- 7. planning refuses what applying would get wrong ------------------------------


def add_scheduler_attributes(state: dict) -> None:
    pairs = state["scheduler"]["$stateful"]["state"]["$dict"]
    pairs.append(["step", 0])  # would shadow the step() method
    pairs.append(["optimizer", {"param_groups": []}])  # would detach it from the optimizer


def test_scheduler_state_cannot_inject_attributes(store, two_steps):
    paths, _ = two_steps
    forge_manifest(paths[2], tree(add_scheduler_attributes))
    assert_refused_untouched(store, "not in the live torch.optim.lr_scheduler.StepLR")
    # strict=False loads what matches, and still never the foreign keys.
    fresh = make_training_state(seed=9)
    outcome = restore_into(store, fresh, strict=False)
    assert isinstance(outcome, cv.RestoreInfo), outcome
    if outcome.step == 2:
        assert any("['step']" in entry for entry in outcome.unexpected)
        assert fresh["scheduler"].last_epoch == 2
    assert_scheduler_intact(fresh)


def test_scheduler_state_layout_is_checked_all_the_way_down(store, two_steps):
    paths, _ = two_steps

    def base_lrs_become_a_dict(state: dict) -> None:
        set_pair(state["scheduler"]["$stateful"]["state"]["$dict"], "base_lrs", {"__class__": 1})

    forge_manifest(paths[2], tree(base_lrs_become_a_dict))
    assert_refused_untouched(store, "base_lrs")


class Counter:
    """A user's stateful object whose load_state_dict is a ``__dict__.update``."""

    def __init__(self) -> None:
        self.count = 0

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


class Fragile(Counter):
    """Refuses to load when told to: an object's own code failing during apply."""

    refuse = False

    def load_state_dict(self, state: dict) -> None:
        if self.refuse:
            raise ValueError("cannot take that")
        super().load_state_dict(state)


def test_generic_stateful_state_cannot_inject_attributes(store):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        counter = Counter()
        for step in (1, 2):
            counter.count = step
            mgr.save(step, {"counter": counter})
    step_2 = next(store.glob("step-000000000002.*"))
    forge_manifest(
        step_2,
        tree(lambda s: s["counter"]["$stateful"]["state"].__setitem__("state_dict", 1)),
    )
    fresh = Counter()
    outcome = restore_into(store, {"counter": fresh})
    if isinstance(outcome, cv.RestoreInfo):
        assert outcome.step == 1 and fresh.count == 1
    else:
        assert isinstance(outcome, StateMismatchError) and "state_dict" in str(outcome)
        assert fresh.count == 0
    assert "state_dict" not in vars(fresh) and fresh.state_dict() == {"count": fresh.count}


def test_optimizer_groups_that_are_not_groups(store, two_steps):
    paths, _ = two_steps

    def groups_are_numbers(state: dict) -> None:
        set_pair(state["optimizer"]["$stateful"]["state"]["$dict"], "param_groups", [1, 2])

    forge_manifest(paths[2], tree(groups_are_numbers))
    assert_refused_untouched(store, "param_groups")


def test_module_entry_that_is_not_a_tensor(store, two_steps):
    paths, _ = two_steps
    forge_manifest(
        paths[2], tree(lambda s: set_pair(s["model"]["$stateful"]["state"]["$dict"], "fc2.bias", 5))
    )
    assert_refused_untouched(store, "fc2.bias")


def test_malformed_rng_states_are_tried_before_anything_is_set(store, two_steps):
    paths, _ = two_steps

    def short_python_state(state: dict) -> None:
        pairs = state["rng"]["$rng"]["$dict"]
        python = next(value for key, value in pairs if key == "python")["$tuple"]
        python[1] = {"$tuple": [1, 2, 3]}  # decodes fine; random.setstate refuses it

    forge_manifest(paths[2], tree(short_python_state))
    random.seed(1234)
    expected = random.getstate()
    outcome = assert_refused_untouched(store, "python")
    if isinstance(outcome, CheckpointError):  # refused: the global RNGs were not touched
        assert random.getstate() == expected


def test_malformed_numpy_generator_state(store, two_steps):
    paths, _ = two_steps
    forge_manifest(
        paths[2],
        tree(
            lambda s: s.__setitem__(
                "sampler_rng", {"$np_generator": {"bit_generator": "PCG64", "state": "junk"}}
            )
        ),
    )
    assert_refused_untouched(store, "sampler_rng")


def test_malformed_torch_generator_state(store):
    state = {"gen": torch.Generator().manual_seed(3), "buf": torch.ones(16, dtype=torch.uint8)}
    state["meta"] = {"n": 1}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        for step in (1, 2):
            state["meta"]["n"] = step
            mgr.save(step, state)
    step_2 = next(store.glob("step-000000000002.*"))

    def short_state(document: dict) -> None:
        # A 1-d uint8 tensor (so it decodes), of the wrong size for a generator state.
        document["state"]["gen"]["$torch_generator"]["state"] = {"$tensor": "buf"}

    forge_manifest(step_2, short_state)
    fresh = {
        "gen": torch.Generator().manual_seed(99),
        "buf": torch.zeros(16, dtype=torch.uint8),
        "meta": {"n": 0},
    }
    live = fresh["gen"].get_state().clone()
    outcome = restore_into(store, fresh)
    if isinstance(outcome, cv.RestoreInfo):
        assert outcome.step == 1 and fresh["meta"]["n"] == 1
    else:
        assert isinstance(outcome, StateMismatchError) and "state['gen']" in str(outcome)
        assert torch.equal(fresh["gen"].get_state(), live) and fresh["meta"]["n"] == 0
        assert not fresh["buf"].any()


@pytest.mark.parametrize("fields", [[[1]], "x", {"1": {"$dict": [[[1], 2]]}}])
def test_hostile_contract_shapes(store, fields):
    state = make_training_state()
    with cv.CheckpointManager(store, run_id="r", contract={"dataset": "ds"}) as mgr:
        for step in (1, 2):
            train_steps(state, 1)
            mgr.save(step, state)
    step_2 = next(store.glob("step-000000000002.*"))
    forge_manifest(step_2, lambda document: document["contract"].__setitem__("fields", fields))
    outcome = assert_refused_untouched(store, contract={"dataset": "ds"})
    assert isinstance(outcome, (cv.RestoreInfo, FormatError, ContractMismatch)), outcome


def test_compare_contracts_only_raises_typed_errors():
    for stored in ({"fields": [[1]]}, {"fields": "x"}, [], {"fields": {1: 2}}):
        with pytest.raises(FormatError, match="contract is malformed"):
            compare_contracts(stored, {"a": 1}, "generation g")  # type: ignore[arg-type]
    with pytest.raises(ContractMismatch, match=r"a: \[\[1\]\] → 1"):
        compare_contracts({"fields": {"a": [[1]]}}, {"a": 1}, "generation g")
    compare_contracts({"fields": {"a": 1}}, {"a": 1}, "generation g")


def test_apply_failures_are_typed_and_name_the_entry(store):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, {"obj": Fragile(), "meta": {"n": 1}})
    meta = {"n": 0}
    fragile = Fragile()
    fragile.refuse = True
    with (
        cv.CheckpointManager(store, run_id="r") as mgr,
        pytest.raises(StateMismatchError, match=r"state\['obj'\].*ValueError") as caught,
    ):
        mgr.restore({"obj": fragile, "meta": meta})
    assert caught.value.mismatched == ["state['obj']"]
    # Loads into objects run before plain values are replaced, RNG last.
    assert meta == {"n": 0}


def test_plan_apply_order_loads_then_contents_then_rng(store):
    state = make_training_state()
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, state)
        loaded = mgr.restore(make_training_state(seed=1))
    assert loaded is not None
    from ckptvault.io.load import load_verified
    from ckptvault.trust.checks import TrustPolicy

    opened = PosixStore(store)
    ref = opened.list_generations()[0]
    saved = load_verified(opened, ref, TrustPolicy(), None, 1).saved
    plan = plan_restore(make_training_state(seed=2), saved)
    steps = (*plan.object_loads, *plan.actions, *plan.replacements, *plan.rng_actions)
    wheres = [a.where for a in steps]
    assert wheres.index("state['model']") < wheres.index("state['meta']")
    assert wheres[-2:] == ["state['rng']", "state['sampler_rng']"]
