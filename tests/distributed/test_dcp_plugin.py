"""ckptvault as a storage plugin of plain ``torch.distributed.checkpoint`` code:
``cv.dcp.StorageWriter`` / ``cv.dcp.StorageReader`` with ``dcp.save``,
``dcp.async_save`` and ``dcp.load``, on one process and on gloo process groups
(``dcp_worker.py`` holds the multi-rank scenarios): DCP's canonical state dict
(``get_state_dict``, its ``param_groups`` stored as JSON) and ckptvault's own errors
out of plain DCP calls."""

from __future__ import annotations

import json
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_loader, state_dict_saver
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptvault as cv
from ckptvault.errors import (
    IntegrityError,
    NoValidCheckpoint,
    StateMismatchError,
    StoreLockedError,
    UsageError,
)
from ckptvault.trust.signing import generate_keypair
from support.common import run_cli, writable
from support.dcp_worker import launch
from support.forging import read_logical, write_logical

RUN = "dcp-run"
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")


def nested_state(scale: int) -> dict[str, Any]:
    """A nested state dict of many kinds of tensors, as DCP users hand it over."""
    weight = torch.arange(24, dtype=torch.float32).reshape(4, 6) * scale
    return {
        "model": {
            "encoder": {"weight": weight, "bias": torch.full((4,), 0.5 * scale)},
            "head": {"weight": weight.t()[:3], "scale": torch.tensor(1.25 * scale)},  # a view
        },
        "optim": {"state": {"step": torch.tensor(scale, dtype=torch.int64)}},
        "buffers": {
            "half": torch.linspace(-1, 1, 7, dtype=torch.bfloat16) * scale,
            "mask": torch.tensor([True, False, scale % 2 == 1]),
        },
    }


def zeros_like(tree: Any) -> Any:
    if isinstance(tree, dict):
        return {key: zeros_like(value) for key, value in tree.items()}
    return torch.zeros_like(tree).contiguous()


def assert_bit_exact(loaded: Any, expected: Any) -> None:
    if isinstance(expected, dict):
        assert sorted(loaded) == sorted(expected)
        for key in expected:
            assert_bit_exact(loaded[key], expected[key])
        return
    assert loaded.dtype == expected.dtype and loaded.shape == expected.shape
    assert torch.equal(loaded.view(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))


def save(store: Path, step: int, state: dict[str, Any] | None = None, **options: Any) -> Any:
    writer = cv.dcp.StorageWriter(store, run_id=options.pop("run_id", RUN), step=step, **options)
    dcp.save(state if state is not None else nested_state(step), storage_writer=writer)
    return writer


def generations(store: Path) -> list[Path]:
    return sorted(store.glob("step-*"))


def largest_data_file(generation: Path) -> Path:
    return max(generation.glob("r*-*"), key=lambda p: p.stat().st_size)


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(writable(path).read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


# -- one process --------------------------------------------------------------------------


def test_nested_dicts_round_trip_bit_exact_and_verify_accepts_the_store(store):
    writer = save(store, 7)
    assert writer.published is not None and writer.published.step == 7
    [generation] = generations(store)
    manifest = json.loads((generation / "manifest.json").read_text())
    assert manifest["run_id"] == RUN and manifest["state"] == {}
    assert manifest["writer"]["via"] == "ckptvault.dcp" and manifest["writer"]["world_size"] == 1
    assert list(manifest["indexes"]) == ["r00000-index.json"]
    assert "model.encoder.weight" in manifest["tensors"]  # the root's tensor table
    assert "model.encoder.weight" in read_logical(generation)["dcp"]["tensors"]
    assert not list((store / ".staging").iterdir())

    live = zeros_like(nested_state(7))
    reader = cv.dcp.StorageReader(store, run_id=RUN)
    dcp.load(live, storage_reader=reader)
    assert_bit_exact(live, nested_state(7))
    assert (reader.step, reader.generation_id) == (7, writer.published.generation_id)
    assert reader.signer is None and reader.skipped == []

    result = run_cli("verify", str(store), "--run-id", RUN)
    assert result.returncode == 0, result.stdout + result.stderr


def test_cv_dcp_is_reachable_from_the_package():
    assert cv.dcp.StorageWriter is not None and callable(cv.dcp.typed_errors)


def test_plain_values_are_stored_as_json_and_restored_in_place(store):
    state = {
        "model": {"w": torch.ones(3)},
        "epoch": 3,
        "name": "run",
        "lr": [0.1, float("nan")],
        "meta": {"betas": (0.9, 0.99), "flag": None, "blob": b"\x00\xff"},
    }
    save(store, 1, state)
    [generation] = generations(store)
    stored = json.loads((generation / "manifest.json").read_text())["state"]["dcp_objects"]
    assert stored["epoch"] == 3 and stored["meta.betas"] == {"$tuple": [0.9, 0.99]}
    live = {
        "model": {"w": torch.zeros(3)},
        "epoch": 0,
        "name": "",
        "lr": [],
        "meta": {"betas": (0.0, 0.0), "flag": True, "blob": b""},
    }
    dcp.load(live, storage_reader=cv.dcp.StorageReader(store, run_id=RUN))
    assert live["epoch"] == 3 and live["name"] == "run" and live["lr"][0] == 0.1
    assert live["lr"][1] != live["lr"][1]  # NaN
    assert live["meta"] == {"betas": (0.9, 0.99), "flag": None, "blob": b"\x00\xff"}
    assert type(live["meta"]["betas"]) is tuple and torch.equal(live["model"]["w"], torch.ones(3))


def test_a_value_json_cannot_hold_raises_usage_error_out_of_plain_dcp_save(store):
    state = {"model": {"w": torch.ones(3)}, "epoch": 3, "ids": {1, 2}, "hook": print}
    with pytest.raises(UsageError) as raised:
        dcp.save(state, storage_writer=cv.dcp.StorageWriter(store, run_id=RUN, step=1))
    for words in ("2 state dict value(s)", "'hook'", "'ids'", "pickle", "Nothing was published"):
        assert words in str(raised.value)
    assert isinstance(raised.value.__cause__, CheckpointException)  # DCP's, kept as the cause
    future = dcp.async_save(state, storage_writer=cv.dcp.StorageWriter(store, run_id=RUN, step=1))
    with pytest.raises(UsageError, match="'hook'"):
        future.result()
    with pytest.raises(UsageError, match="cannot be stored"), cv.dcp.typed_errors():
        save(store, 1, state)  # the context of earlier versions still works
    assert generations(store) == []
    assert not (store / ".staging").exists() or not list((store / ".staging").iterdir())


def test_other_storage_writers_still_raise_dcps_own_exception(tmp_path):
    cv.dcp.StorageWriter(tmp_path / "store", run_id=RUN, step=1)  # installs the unwrapping
    assert getattr(state_dict_saver._save_state_dict, "_ckptvault_unwraps", False)
    assert getattr(state_dict_loader._load_state_dict, "_ckptvault_unwraps", False)
    (tmp_path / "blocker").write_text("a file where DCP wants a directory")
    with pytest.raises(CheckpointException) as raised:
        dcp.save({"w": torch.ones(2)}, storage_writer=dcp.FileSystemWriter(tmp_path / "blocker"))
    assert any(isinstance(e, OSError) for e, _ in raised.value.failures.values())


def adam_model(seed: int, **hyper: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    return model, torch.optim.Adam(model.parameters(), **hyper)


def adam_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seeds: range) -> None:
    for seed in seeds:
        batch = torch.Generator().manual_seed(seed)
        model(torch.randn(8, 6, generator=batch)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


@contextmanager
def no_pickle(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every pickle entry point (torch.save/load included) raises inside."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pickle was used")

    with monkeypatch.context() as patch:
        for name in ("dump", "dumps", "load", "loads", "Pickler", "Unpickler"):
            patch.setattr(pickle, name, refuse)
        patch.setattr(torch, "save", refuse)
        patch.setattr(torch, "load", refuse)
        yield


def test_get_state_dict_with_adam_round_trips_and_training_goes_on_identically(store, monkeypatch):
    hyper = {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-7, "weight_decay": 0.1}
    model, optimizer = adam_model(0, **hyper)
    adam_steps(model, optimizer, range(2))
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with no_pickle(monkeypatch):
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            storage_writer=cv.dcp.StorageWriter(store, run_id=RUN, step=2),
        )

    fresh, fresh_optimizer = adam_model(5, lr=0.5)  # other weights and hyperparameters
    fresh_model_sd, fresh_optim_sd = get_state_dict(fresh, fresh_optimizer)
    state = {"model": fresh_model_sd, "optim": fresh_optim_sd}
    with no_pickle(monkeypatch):
        dcp.load(state, storage_reader=cv.dcp.StorageReader(store, run_id=RUN))
    set_state_dict(
        fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )

    [group], [restored] = optimizer.param_groups, fresh_optimizer.param_groups
    hyperparameters = {k: v for k, v in group.items() if k != "params"}
    assert {k: v for k, v in restored.items() if k != "params"} == hyperparameters
    assert restored["betas"] == (0.8, 0.95) and type(restored["betas"]) is tuple
    expected, loaded = optimizer.state_dict(), fresh_optimizer.state_dict()
    assert loaded["param_groups"] == expected["param_groups"]
    for index, moments in expected["state"].items():
        assert sorted(loaded["state"][index]) == sorted(moments)  # step, exp_avg, exp_avg_sq
        assert_bit_exact(loaded["state"][index], moments)
    assert_bit_exact(fresh.state_dict(), model.state_dict())

    adam_steps(model, optimizer, range(2, 5))  # the run never stopped
    adam_steps(fresh, fresh_optimizer, range(2, 5))  # the run resumed from the store
    assert_bit_exact(fresh.state_dict(), model.state_dict())
    assert_bit_exact(fresh_optimizer.state_dict()["state"], optimizer.state_dict()["state"])


def test_a_load_planner_that_unpickles_is_refused_before_anything_is_loaded(store):
    save(store, 1, {"w": torch.ones(3), "epoch": 3})

    class UnpicklingPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            raise AssertionError("never called")

    live = {"w": torch.zeros(3), "epoch": 0}
    reader = cv.dcp.StorageReader(store, run_id=RUN)
    with pytest.raises(UsageError, match="pickled bytes"):
        dcp.load(live, storage_reader=reader, planner=UnpicklingPlanner())
    assert live["epoch"] == 0 and torch.equal(live["w"], torch.zeros(3))


def test_a_tampered_value_is_refused_before_anything_is_applied(store, tmp_path):
    signer = tmp_path / "k.pem"
    generate_keypair(signer, tmp_path / "k.pub")
    save(store, 1, {"w": torch.ones(2), "lr": 0.5}, signing_key=signer)
    save(store, 2, {"w": torch.ones(2), "lr": 0.25}, signing_key=signer)
    newest = generations(store)[-1]
    manifest = newest / "manifest.json"
    original = manifest.read_bytes()
    # Edited in place (canonical still): the manifest's self-digest no longer matches.
    writable(manifest).write_bytes(original.replace(b'"lr":0.25', b'"lr":0.75'))
    live = {"w": torch.zeros(2), "lr": 0.0}
    with pytest.raises(NoValidCheckpoint, match="own digest"):
        cv.dcp.StorageReader(store, run_id=RUN, step=2)
    # Edited with every digest recomputed, as anyone who can write the store can:
    # the signature no longer matches.
    writable(manifest).write_bytes(original)
    document = read_logical(newest)
    document["state"]["dcp_objects"]["lr"] = 0.75
    write_logical(newest, document)
    trusting = {"trusted_keys": tmp_path / "k.pub"}
    with pytest.raises(NoValidCheckpoint, match="signature-invalid"):
        cv.dcp.StorageReader(store, run_id=RUN, step=2, **trusting)
    reader = cv.dcp.StorageReader(store, run_id=RUN, **trusting)  # falls back to step 1
    assert reader.step == 1 and "signature-invalid" in reader.skipped[0].reason
    assert live["lr"] == 0.0  # nothing was applied
    dcp.load(live, storage_reader=reader)
    assert live["lr"] == 0.5


def test_a_json_value_where_the_state_dict_holds_a_tensor_is_refused(store):
    """An unsigned generation whose tensor entry was replaced by a JSON value (taken
    out of DCP's metadata, put into ``dcp_objects``): DCP plans a byte read for the
    live tensor, and the value took the tensor's place in the caller's state dict
    (``set_state_dict`` then failed deep in torch). A plugin save never stores a
    tensor as a value: refused, nothing loaded."""
    save(store, 1, {"w": torch.arange(3.0), "lr": 0.5})
    generation = generations(store)[-1]
    document = read_logical(generation)
    del document["dcp"]["tensors"]["w"]
    document["state"]["dcp_objects"]["w"] = 5
    write_logical(generation, document)
    live = {"w": torch.zeros(3), "lr": 0.0}
    with pytest.raises(StateMismatchError, match=r"'w'.*JSON value.*holds a tensor"):
        dcp.load(live, storage_reader=cv.dcp.StorageReader(store, run_id=RUN))
    assert torch.equal(live["w"], torch.zeros(3)) and live["lr"] == 0.0


def test_async_save_then_load(store):
    writer = cv.dcp.StorageWriter(store, run_id=RUN, step=3)
    future = dcp.async_save(nested_state(3), storage_writer=writer)
    future.result()
    assert writer.published is not None and [g.name[:17] for g in generations(store)] == [
        "step-000000000003"
    ]
    live = zeros_like(nested_state(3))
    dcp.load(live, storage_reader=cv.dcp.StorageReader(store, run_id=RUN))
    assert_bit_exact(live, nested_state(3))


def test_newest_first_or_a_given_step(store):
    save(store, 1)
    save(store, 2)
    live = zeros_like(nested_state(1))
    dcp.load(live, storage_reader=cv.dcp.StorageReader(store, run_id=RUN))
    assert_bit_exact(live, nested_state(2))
    reader = cv.dcp.StorageReader(store, run_id=RUN, step=1)
    dcp.load(live, storage_reader=reader)
    assert reader.step == 1
    assert_bit_exact(live, nested_state(1))
    with pytest.raises(NoValidCheckpoint, match="no generation of step 9"):
        cv.dcp.StorageReader(store, run_id=RUN, step=9)
    with pytest.raises(NoValidCheckpoint, match="run-mismatch"):
        cv.dcp.StorageReader(store, run_id="another-run")


def test_a_corrupt_byte_read_during_load_raises_integrity_error(store):
    big = torch.arange(3 * 1024 * 1024, dtype=torch.float32)  # 12 MiB: several chunks
    save(store, 1, {"big": big, "small": torch.ones(2)})
    data_file = largest_data_file(generations(store)[0])
    flip_byte(data_file, data_file.stat().st_size - 100)  # in the last chunk, not the header

    live = {"big": torch.zeros_like(big), "small": torch.zeros(2)}
    reader = cv.dcp.StorageReader(store, run_id=RUN)  # the header checks pass
    with pytest.raises(IntegrityError, match="digest") as raised:  # out of plain dcp.load
        dcp.load(live, storage_reader=reader)
    [(error, _trace)] = raised.value.__cause__.failures.values()  # DCP's wrapper, the cause
    assert error is raised.value


def test_a_file_cut_short_after_the_checks_puts_no_byte_into_the_callers_tensors(store):
    """Red-team finding (round 3): the tensor file overwritten and cut by one byte
    after the reader's checks passed. The short last block must be refused before it
    is copied: the caller's tensor keeps every one of its own values."""
    values = torch.arange(65536, dtype=torch.float32)
    save(store, 1, {"w": values})
    data_file = largest_data_file(generations(store)[0])
    reader = cv.dcp.StorageReader(store, run_id=RUN)  # the checks pass here
    size = data_file.stat().st_size
    writable(data_file).write_bytes(b"A" * (size - 1))
    live = {"w": torch.full((65536,), -1.0)}
    with pytest.raises(IntegrityError):
        dcp.load(live, storage_reader=reader)
    assert torch.equal(live["w"], torch.full((65536,), -1.0))


def test_a_corrupt_generation_is_skipped_with_its_reason_never_silently(store):
    save(store, 1)
    save(store, 2)
    newest = generations(store)[-1]
    flip_byte(largest_data_file(newest), 20)  # inside the header chunk
    reader = cv.dcp.StorageReader(store, run_id=RUN)
    assert reader.step == 1
    [skipped] = reader.skipped
    assert skipped.step == 2 and "digest-mismatch" in skipped.reason
    with pytest.raises(NoValidCheckpoint, match="digest-mismatch"):
        cv.dcp.StorageReader(store, run_id=RUN, step=2)
    assert run_cli("verify", str(store), "--step", "2").returncode != 0


def test_signed_saves_verify_against_trusted_keys(store, tmp_path):
    signer = generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    generate_keypair(tmp_path / "other.pem", tmp_path / "other.pub")
    save(store, 1)  # unsigned
    save(store, 2, signing_key=tmp_path / "k.pem")
    assert (generations(store)[-1] / "manifest.sig").exists()
    reader = cv.dcp.StorageReader(store, run_id=RUN, trusted_keys=tmp_path / "k.pub")
    assert reader.step == 2 and reader.signer == signer
    with pytest.raises(NoValidCheckpoint) as refused:
        cv.dcp.StorageReader(store, run_id=RUN, trusted_keys=[tmp_path / "other.pub"])
    assert "signature-untrusted" in str(refused.value) and "signature-missing" in str(refused.value)
    trusted = ["verify", str(store), "--trusted-key", str(tmp_path / "k.pub")]
    assert run_cli(*trusted).returncode == 0


def test_encrypted_with_a_keystore(store, tmp_path):
    keystore = tmp_path / "keys"
    save(store, 4, {**nested_state(4), "note": "secret-note"}, keystore=keystore)
    names = sorted(p.name for p in generations(store)[0].iterdir())
    # Every data file is encrypted, the state file with the non-tensor values too;
    # the index (chunk digests, names, shapes, as the format-2 manifest held them) is
    # plaintext, like the root.
    assert "r00000-index.json" in names and "r00000-state.json.enc" in names
    assert all(n.endswith(".enc") for n in names if n.startswith("r") and n != "r00000-index.json")
    assert not any(b"secret-note" in p.read_bytes() for p in generations(store)[0].iterdir())
    live = {**zeros_like(nested_state(4)), "note": ""}
    dcp.load(live, storage_reader=cv.dcp.StorageReader(store, run_id=RUN, keystore=keystore))
    assert live.pop("note") == "secret-note"
    assert_bit_exact(live, nested_state(4))
    with pytest.raises(NoValidCheckpoint, match="key-unavailable"):
        cv.dcp.StorageReader(store, run_id=RUN)


def test_misuse_is_refused_clearly(store):
    with pytest.raises(UsageError, match="run_id"):
        cv.dcp.StorageWriter(store, run_id="", step=1)
    with pytest.raises(UsageError, match="step"):
        cv.dcp.StorageWriter(store, run_id=RUN, step=-1)
    with pytest.raises(UsageError, match="enable_plan_caching"):
        dcp.save(
            nested_state(1),
            storage_writer=cv.dcp.StorageWriter(store, run_id=RUN, step=1),
            planner=DefaultSavePlanner(enable_plan_caching=True),
        )
    assert generations(store) == []
    with pytest.raises(UsageError, match="thread-based"):
        pickle.dumps(cv.dcp.StorageWriter(store, run_id=RUN, step=1))
    with pytest.raises(UsageError, match="no checkpoint store"):
        cv.dcp.StorageReader(store.parent / "nowhere", run_id=RUN)


def test_a_manager_writing_the_same_store_keeps_the_plugin_out(store):
    with cv.CheckpointManager(store, run_id=RUN) as manager:
        manager.save(1, {"w": torch.ones(2)})
        with pytest.raises(StoreLockedError):
            save(store, 2)
    assert [g.name[:17] for g in generations(store)] == ["step-000000000001"]
    save(store, 2)  # once the manager is closed
    assert len(generations(store)) == 2


def test_s3_store_with_an_explicit_endpoint(s3_bucket, s3_endpoint):
    url = f"s3://{s3_bucket}/dcp"
    writer = cv.dcp.StorageWriter(url, run_id=RUN, step=2, s3_endpoint_url=s3_endpoint)
    dcp.save(nested_state(2), storage_writer=writer)
    assert writer.published is not None
    live = zeros_like(nested_state(2))
    reader = cv.dcp.StorageReader(url, run_id=RUN, s3_endpoint_url=s3_endpoint)
    dcp.load(live, storage_reader=reader)
    assert reader.step == 2
    assert_bit_exact(live, nested_state(2))


def test_a_data_file_swapped_for_a_symlink_is_never_followed(store, tmp_path):
    save(store, 1)
    save(store, 2)
    outside = tmp_path / "outside.bin"
    data_file = largest_data_file(generations(store)[-1])
    outside.write_bytes(data_file.read_bytes())
    writable(data_file).unlink()
    data_file.symlink_to(outside)
    reader = cv.dcp.StorageReader(store, run_id=RUN)
    assert reader.step == 1 and "unsafe-entry" in reader.skipped[0].reason


# -- many ranks (gloo on 127.0.0.1) ------------------------------------------------------


def ok(codes: list[int], reports: list[dict[str, Any]]) -> list[dict[str, Any]]:
    assert codes == [0] * len(codes), [r["log"][-2500:] for r in reports]
    return reports


@pytest.fixture(scope="module")
def fsdp_store(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str], dict]:
    """A fully_shard-ed MLP and its Adam state after one step (get_state_dict's,
    param_groups included), saved by 2 ranks with plain dcp.save (signed); then a save
    of a value JSON cannot hold, refused."""
    root = tmp_path_factory.mktemp("fsdp")
    key_id = generate_keypair(root / "k.pem", root / "k.pub")
    env = {"TEST_KEYS": f"{root / 'k.pem'}:{root / 'k.pub'}"}
    saved = ok(*launch("fsdp_save", root / "store", 2, root / "save", env))
    assert saved[0]["digests"] == saved[1]["digests"]
    assert saved[0]["groups"] == saved[1]["groups"] and saved[0]["groups"][0]["lr"] == 0.05
    info = {"key_id": key_id, "digests": saved[0]["digests"], "groups": saved[0]["groups"]}
    return root / "store", env, {**info, "refused": [r.get("refused") for r in saved]}


def test_two_fsdp_ranks_publish_one_signed_generation(fsdp_store):
    store, _env, _saved = fsdp_store
    [generation] = generations(store)
    root = json.loads((generation / "manifest.json").read_text())
    assert sorted(root["indexes"]) == ["r00000-index.json", "r00001-index.json"]
    manifest = read_logical(generation)
    assert manifest["writer"]["world_size"] == 2
    assert sorted(manifest["files"]) == ["r00000-000.safetensors", "r00001-000.safetensors"]
    chunks = manifest["dcp"]["tensors"]["model.0.weight"]["chunks"]
    assert [c["offsets"] for c in chunks] == [[0, 0], [5, 0]]  # one shard from each rank
    assert "optim.state.0.weight.exp_avg" in manifest["dcp"]["tensors"]
    values = manifest["state"]["dcp_objects"]  # param_groups: JSON, written by both ranks
    assert values["optim.param_groups.0.lr"] == 0.05
    assert values["optim.param_groups.0.params"][0] == "0.weight"
    trusted = ["verify", str(store), "--trusted-key", str(store.parent / "k.pub")]
    assert run_cli(*trusted).returncode == 0


def test_two_ranks_raise_ckptvault_s_error_out_of_plain_dcp_save(fsdp_store):
    store, _env, saved = fsdp_store
    for kind, message in saved["refused"]:  # one a rank
        assert kind == "ckptvault.errors.UsageError"
        assert "'hooks'" in message and "Nothing was published" in message
    assert len(generations(store)) == 1
    assert not list((store / ".staging").iterdir())


def test_two_fsdp_ranks_reshard_onto_three_with_set_state_dict(fsdp_store, tmp_path):
    store, env, saved = fsdp_store
    loaded = ok(*launch("fsdp_load", store, 3, tmp_path, env))
    for report in loaded:
        assert report["step"] == 1 and report["signer"] == saved["key_id"]
        assert report["digests"] == saved["digests"]  # model and Adam state, bit-exact
        assert report["groups"] == saved["groups"]  # lr 0.05, not the loader's 0.5
        assert report["stepped"]
    assert [r["local_rows"] for r in loaded] == [4, 4, 2]  # 10 rows over 3 ranks


def test_async_save_on_two_ranks_then_load(tmp_path):
    reports = ok(*launch("async_roundtrip", tmp_path / "store", 2, tmp_path / "out"))
    assert all(r["step"] == 4 and r["exact"] for r in reports)
    assert len(generations(tmp_path / "store")) == 2


def test_a_rank_failing_mid_save_publishes_nothing_and_every_rank_raises(tmp_path):
    store = tmp_path / "store"
    reports = ok(*launch("fail_in_write", store, 2, tmp_path / "out"))
    for report in reports:
        assert report["error"][0] == "OSError" and "injected on rank 1" in report["error"][1]
    assert reports[0]["staging_after_failure"] == []
    assert reports[0]["published"] == 6
    assert [g.name[:17] for g in generations(store)] == ["step-000000000006"]
