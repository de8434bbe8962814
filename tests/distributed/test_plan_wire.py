"""What crosses ranks in a multi-rank save and restore, checked in one process.

The codecs of DCP's plans and write results (``distributed/plan_wire.py``,
``distributed/result_wire.py``), the coordinator's framing and bounded decoding, the
small verdict messages, and the whole DCP save driver on a one-rank coordinator
(the two-rank job: ``test_no_pickle_between_ranks.py``). Everything hostile must
raise :class:`PeerMessageError` and nothing else.
"""

from __future__ import annotations

import ast
import copy
import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex

from ckptvault.coordinator import Coordinator, SingleProcess
from ckptvault.distributed import coordinator as framing
from ckptvault.distributed import messages
from ckptvault.distributed.dcp_load import check_local_only
from ckptvault.distributed.dcp_save import write_tensors_together
from ckptvault.distributed.plan_wire import (
    assigned_plan,
    assignment,
    plan_from_json,
    plan_to_json,
)
from ckptvault.distributed.result_wire import results_from_json, results_to_json
from ckptvault.errors import PeerMessageError, UsageError
from ckptvault.format.layout import new_generation_id
from ckptvault.io.dcp_io import write_tensors
from ckptvault.io.planners import TensorOnlyLoadPlanner, TensorOnlySavePlanner
from ckptvault.io.ranged_reader import RangedStorageReader
from ckptvault.storage import open_store

TENSORS = {
    "model/w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "model/b": torch.ones(4, dtype=torch.bfloat16),
    "step": torch.tensor(7),
}


def wire(value: Any) -> Any:
    """What a peer's message looks like after the coordinator's JSON."""
    return json.loads(json.dumps(value))


def local_plan(tensors: dict[str, torch.Tensor] = TENSORS) -> Any:
    planner = TensorOnlySavePlanner()
    planner.set_up_planner(state_dict=tensors, storage_meta=None, is_coordinator=True)
    return planner, planner.create_local_plan()


def test_a_local_plan_round_trips_and_a_global_plan_comes_back_as_positions():
    planner, mine = local_plan()
    plans = [plan_from_json(wire(plan_to_json(mine)), rank) for rank in (0, 1)]
    assert [(i.index, i.type, i.tensor_data) for i in plans[0].items] == [
        (i.index, i.type, i.tensor_data) for i in mine.items
    ]
    central, _metadata = planner.create_global_plan(plans)
    # Every tensor is replicated and small: rank 0 writes them all, rank 1 nothing.
    parts = [assigned_plan(mine, wire(assignment(plans[r], central[r], r))) for r in (0, 1)]
    assert [i.index for i in parts[0].items] == [i.index for i in central[0].items]
    assert [i.index.index for i in parts[0].items] == [i.index.index for i in central[0].items]
    assert parts[1].items == []


HOSTILE_ITEMS = [
    ["w", "tensor", "float32", [3, 4], [0, 0], [3, 4], "extra"],  # seven fields
    [1, "tensor", "float32", [3], [0], [3]],  # a name that is not a string
    ["", "tensor", "float32", [3], [0], [3]],  # an empty name
    ["w" * 5000, "tensor", "float32", [3], [0], [3]],  # a huge name
    ["w", "bytes", "float32", [3], [0], [3]],  # DCP's pickled kind
    ["w", "tensor", "Tensor", [3], [0], [3]],  # not a dtype name
    ["w", "tensor", "__class__", [3], [0], [3]],  # an attribute of torch, not a dtype
    ["w", "tensor", "float32", [3.0], [0], [3]],  # a float dimension
    ["w", "tensor", "float32", [True], [0], [1]],  # a bool dimension
    ["w", "tensor", "float32", [-3], [0], [3]],  # a negative dimension
    ["w", "tensor", "float32", [2**70], [0], [1]],  # past int64
    ["w", "shard", "float32", [3], [2], [2]],  # a box outside the shape
    ["w", "tensor", "float32", [3], [1], [2]],  # a whole tensor's box not whole
    ["w", "shard", "float32", [3, 4], [0], [3]],  # offsets of another rank
    ["w", "shard", "float32", [3], [0], [3, 1]],
]


@pytest.mark.parametrize("item", HOSTILE_ITEMS, ids=range(len(HOSTILE_ITEMS)))
def test_a_hostile_plan_item_is_refused(item):
    with pytest.raises(PeerMessageError, match="rank 1 sent a save plan"):
        plan_from_json(wire({"items": [item]}), 1)


@pytest.mark.parametrize(
    "message",
    [
        None,
        [],
        {"items": {}},
        {"items": [], "planner_data": {}},
        {"items": [["w", "tensor", "float32", [3], [0], [3]]] * 2},  # an item twice
        {"error": 5},
        {"error": "x" * 3000},
    ],
)
def test_a_hostile_plan_message_is_refused(message):
    with pytest.raises(PeerMessageError):
        plan_from_json(wire(message), 1)


@pytest.mark.parametrize(
    "keep",
    [[[1, 0], [0, 0]], [[0, 0], [0, 0]], [[3, 0]], [[-1, 0]], [[True, 0]], [[0, 2**40]], [[0]]],
)
def test_a_hostile_assignment_is_refused(keep):
    _planner, mine = local_plan()
    with pytest.raises(PeerMessageError, match="a plan assignment"):
        assigned_plan(mine, {"keep": keep})


@pytest.fixture
def written(tmp_path: Path) -> tuple[Any, Any]:
    """A real one-rank write through the driver (SingleProcess: every step, every
    codec, no DCP collective) and the same tensors written by ``dcp.save``."""
    (tmp_path / "store").mkdir()
    store = open_store(tmp_path / "store")
    ours = write_tensors_together(
        TENSORS, store.begin_generation(new_generation_id()), 4096, 2, None, SingleProcess()
    )
    dcps = write_tensors(TENSORS, store.begin_generation(new_generation_id()), 4096, 2)
    return ours, dcps


def test_the_driver_writes_what_dcp_save_writes(written):
    ours, dcps = written
    assert ours.dcp_json == dcps.dcp_json
    assert ours.file_records == dcps.file_records and ours.own_files == dcps.own_files


def results_message(tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    """Rank 0's part of a global plan and its write results, as sent."""
    planner, mine = local_plan()
    (tmp_path / "store").mkdir()
    writer_area = open_store(tmp_path / "store").begin_generation(new_generation_id())
    from ckptvault.io.writer import VaultStorageWriter

    writer = VaultStorageWriter(writer_area, chunk_size=4096, threads=2, rank=0)
    results = writer.write_data(mine, planner).value()
    return mine, wire(results_to_json(results))


def test_write_results_round_trip(tmp_path: Path):
    plan, message = results_message(tmp_path)
    results = results_from_json(message, 0, plan, 2, encrypted=False)
    assert {r.index for r in results} == {i.index for i in plan.items}
    records = [r.storage_data.file_record for r in results if r.storage_data.file_record]
    assert len(records) == len(message["files"])


def _hostile_results(message: dict[str, Any]) -> list[dict[str, Any]]:
    name = next(iter(message["files"]))
    variants = []
    for change in (
        lambda m: m["chunks"].pop(),  # a chunk missing
        lambda m: m["chunks"].append(m["chunks"][0]),  # a chunk twice
        lambda m: m["chunks"][0].__setitem__(0, "other"),  # a chunk not assigned
        lambda m: m["chunks"][0].__setitem__(3, "renamed"),  # another entry name
        lambda m: m["chunks"][0].__setitem__(5, 1),  # another length
        lambda m: m["chunks"][0].__setitem__(4, 2**40),  # past the file's end
        lambda m: m["chunks"][0].__setitem__(4, -1),
        lambda m: m["files"].__setitem__("r00001-000.safetensors", m["files"][name]),  # rank 1's
        lambda m: m["files"].__setitem__("../escape", m["files"][name]),
        lambda m: m["files"][name].__setitem__("blake3", "00"),
        lambda m: m["files"][name].__setitem__("size", 2**63),
        lambda m: m["keys"].__setitem__(name, ["kek", "AAAA"]),  # a key in a plain run
        lambda m: m.__setitem__("extra", 1),
    ):
        variant = copy.deepcopy(message)
        change(variant)
        variants.append(variant)
    return variants


def test_hostile_write_results_are_refused(tmp_path: Path):
    plan, message = results_message(tmp_path)
    for variant in _hostile_results(message):
        with pytest.raises(PeerMessageError, match="rank 0 sent write results"):
            results_from_json(variant, 0, plan, 2, encrypted=False)
    with pytest.raises(PeerMessageError):  # an encrypted run's files must end in .enc
        results_from_json(message, 0, plan, 2, encrypted=True)


def test_a_pickle_or_deep_or_lying_frame_is_refused_by_the_coordinator():
    payload = torch.frombuffer(bytearray(pickle.dumps({"a": 1})), dtype=torch.uint8)
    with pytest.raises(PeerMessageError, match="rank 1"):
        framing._decode(payload, 1, "a gather")
    deep = torch.frombuffer(bytearray(b"[" * 10_000 + b"]" * 10_000), dtype=torch.uint8)
    with pytest.raises(PeerMessageError, match="rank 1"):
        framing._decode(deep, 1, "a gather")
    frame = framing._framed(b"[1]", 3)
    frame[:8] = torch.frombuffer(bytearray((2**40).to_bytes(8, "little")), dtype=torch.uint8)
    with pytest.raises(PeerMessageError, match="framed"):
        framing._unframed(frame, 3, 1, "a gather")
    assert framing._refused_size(2**40, 2, "a gather") is not None
    assert framing._refused_size(2**20, 1024 * 1024, "a gather") is not None
    with pytest.raises(PeerMessageError, match="rank 1 had a message"):
        framing._checked({"$oversized": 2**40}, 1)


def test_one_process_is_a_conforming_coordinator():
    single = SingleProcess()
    assert isinstance(single, Coordinator)
    assert single.gather({"a": 1}) == [{"a": 1}] and single.scatter([{"b": 2}]) == {"b": 2}


@pytest.mark.parametrize(
    ("check", "raw"),
    [
        (lambda raw: messages.outcome(raw, 1, "joining"), 5),
        (lambda raw: messages.problems(raw, 1), [["digest-mismatch", "x"]]),
        (lambda raw: messages.problems(raw, 1), [["Digest Mismatch!", "x", None]]),
        (lambda raw: messages.problems(raw, 1), [["rollback", "x", 3]]),
        (lambda raw: messages.problems(raw, 1), [["unreadable", "x", None]] * 40),
        (lambda raw: messages.refusal(raw, 1), ["not a class", "x"]),
        (lambda raw: messages.refusal(raw, 1), "StateMismatchError"),
        (lambda raw: messages.manifest_digest(raw, 1), {"a": 1}),
        (lambda raw: messages.rank_part(raw, 1, 2), {"tree": [], "files": []}),
        (lambda raw: messages.rank_part(raw, 1, 2), {"tree": {}, "files": ["../x"]}),
        (
            lambda raw: messages.rank_part(raw, 1, 2),
            {"tree": {}, "files": ["r00000-000.safetensors"]},
        ),
        (lambda raw: messages.rank_part(raw, 1, 2), {"tree": {}, "files": [], "digests": {"s": 1}}),
    ],
)
def test_hostile_verdicts_are_refused(check, raw):
    with pytest.raises(PeerMessageError, match="rank 1 sent"):
        check(raw)


def test_restore_sends_no_load_plan_because_the_global_step_is_the_identity():
    reader = RangedStorageReader.__new__(RangedStorageReader)
    check_local_only(TensorOnlyLoadPlanner(), reader)  # ckptvault's own: accepted
    plans = [object(), object()]
    assert TensorOnlyLoadPlanner().create_global_plan(plans) is plans  # type: ignore[arg-type]

    class Rebalancing(TensorOnlyLoadPlanner):
        def create_global_plan(self, global_plan):  # type: ignore[no-untyped-def]
            return list(reversed(global_plan))

    with pytest.raises(UsageError, match="global load plan"):
        check_local_only(Rebalancing(), reader)
    assert MetadataIndex("w", [0]) == MetadataIndex("w", [0], index=3)  # hints never compared


def _dcp_calls(tree: ast.AST) -> list[ast.Call]:
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "dcp"
        and node.func.attr in ("save", "load", "async_save")
    ]


def test_no_source_file_runs_a_pickled_collective():
    """Nothing in ckptvault calls torch.distributed's ``*_object`` collectives, and
    DCP runs only in one process (``no_dist=True``): its collectives pickle."""
    root = Path(__file__).resolve().parents[2] / "src" / "ckptvault"
    banned = (
        "gather_object",
        "all_gather_object",
        "broadcast_object_list",
        "scatter_object_list",
        "send_object_list",
        "recv_object_list",
    )
    calls = 0
    for path in root.rglob("*.py"):
        tree = ast.parse(path.read_text())
        used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        used |= {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        used |= {
            a.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for a in node.names
        }
        assert not used & set(banned), f"{path}: uses {sorted(used & set(banned))}"
        for call in _dcp_calls(tree):
            calls += 1
            flags = {k.arg: k.value for k in call.keywords}
            no_dist = flags.get("no_dist")
            assert isinstance(no_dist, ast.Constant) and no_dist.value is True, (
                f"{path}:{call.lineno}: DCP called without no_dist=True"
            )
            assert "process_group" not in flags, f"{path}:{call.lineno}"
    assert calls >= 2  # dcp_io's save and load: the check sees them
