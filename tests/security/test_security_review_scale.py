"""Security review of the scale work (bulk S3 listing, the planner-free restore, the
single-process write path, retention over two tiers): regressions for what it found.

Each test plays a writer of the store (an unsigned store takes any generation a
writer makes) or a user with an unusual but valid state, and checks the contract:
what comes back is what was saved, and a candidate that fails costs nothing once it
has been skipped.
"""

from __future__ import annotations

import os
import weakref
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import StateMismatchError
from ckptvault.format.layout import MANIFEST_NAME
from ckptvault.format.manifest import parse_manifest
from ckptvault.io import dcp_io
from ckptvault.storage import open_store
from ckptvault.storage.s3 import store as s3_module
from ckptvault.storage.s3.client import S3Client
from ckptvault.storage.s3.store import S3Store
from ckptvault.trust.checks import check_structure
from support.common import writable
from support.s3_server import s3_client

# -- the write path: what counts as one tensor written once ----------------------------


def _complex() -> torch.Tensor:
    return torch.complex(torch.arange(4.0), torch.arange(4.0) + 10)


@pytest.mark.parametrize(
    "views",
    [
        lambda z: {"z": z, "conjugate": z.conj()},  # a lazily conjugated view
        lambda z: {"im": z.imag, "negated": z.conj().imag},  # a lazily negated view
    ],
    ids=["conj", "neg"],
)
def test_a_conjugate_or_negative_view_is_not_taken_for_its_base(store: Path, views):
    """``z.conj()`` shares ``z``'s memory, shape, strides, dtype and device, and holds
    other values (its conjugate bit flips every imaginary part); so does the negative
    view ``z.conj().imag`` of ``z.imag``. Written once as if tied, the view came back
    as its base: silently wrong values."""
    state = views(_complex())
    want = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, state)
    live = {k: torch.zeros_like(v.resolve_conj().resolve_neg()) for k, v in state.items()}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        assert mgr.restore(live) is not None
    for key, value in want.items():
        assert torch.equal(live[key], value), key


def test_a_tensor_and_its_detached_alias_are_still_written_once(store: Path):
    """What the identity must keep: the same memory seen the same way is one tensor
    (tied weights), however it is reached."""
    weight = torch.nn.Parameter(torch.randn(3, 4))
    with cv.CheckpointManager(store, run_id="r") as mgr:
        generation = Path(mgr.save(1, {"a": weight, "b": weight.detach()}).result().path)
    opened = open_store(store, must_exist=True)
    manifest = check_structure(opened, opened.list_generations()[0]).manifest  # indexes loaded
    assert len(manifest.dcp["tensors"]) == 1 and manifest.format_version == 3
    root = parse_manifest((generation / MANIFEST_NAME).read_bytes(), "test")
    assert root.tensor_table is not None and len(root.tensor_table.tensors) == 1


# -- the restore: a rejected candidate frees what it allocated -------------------------


def _flip_last_byte(generation: Path) -> None:
    """Flip a bit of the last tensor byte of every tensor file (past the header, which
    the structure checks verify themselves): found only while reading."""
    for path in sorted(generation.glob("*.safetensors")):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        writable(path).write_bytes(bytes(data))


class _Allocations:
    """Watches (without changing) what each candidate's planner-free read allocates."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.candidates: list[list[weakref.ref[torch.Tensor]]] = []
        self.alive_at_each_read: list[int] = []
        original = dcp_io.plan_whole_tensors

        def watching(*args: Any, **kwargs: Any) -> Any:
            # What earlier (rejected) candidates allocated must be gone by now.
            self.alive_at_each_read.append(
                sum(ref() is not None for refs in self.candidates for ref in refs)
            )
            destinations, plans = original(*args, **kwargs)
            self.candidates.append([weakref.ref(t) for t in destinations.values()])
            return destinations, plans

        monkeypatch.setattr(dcp_io, "plan_whole_tensors", watching)


def test_a_rejected_candidate_frees_its_tensors_before_the_next_is_read(store, monkeypatch):
    """The collector is paused during a restore. The error that rejects a candidate
    holds, through its traceback, the frames that allocated the candidate's tensors,
    in a reference cycle only the collector breaks: paused, every rejected candidate
    stayed in memory until the restore ended, so a store with a few damaged (or
    planted) newer generations made a restore need that many times the model's
    memory, and die of it, where it should fall back."""
    weights = {"w": torch.randn(256, 1024), "b": torch.randn(1024)}
    # Many chunks: the structure checks verify the header's, the read finds the last.
    with cv.CheckpointManager(store, run_id="r", chunk_size=1 << 16) as mgr:
        mgr.save(1, {"weights": weights})
        damaged = [Path(mgr.save(step, {"weights": weights}).result().path) for step in (2, 3, 4)]
    for generation in damaged:
        _flip_last_byte(generation)
    allocations = _Allocations(monkeypatch)
    live = {"weights": {k: torch.zeros_like(v) for k, v in weights.items()}}
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(live)
    assert info is not None and info.step == 1 and len(info.skipped) == 3
    assert all(torch.equal(live["weights"][k], v) for k, v in weights.items())
    assert allocations.alive_at_each_read == [0, 0, 0, 0]


# -- apply: all or nothing -------------------------------------------------------------


def _inference_zeros(*shape: int) -> torch.Tensor:
    with torch.inference_mode():
        return torch.zeros(*shape)


def _inference_linear() -> torch.nn.Linear:
    with torch.inference_mode():
        return torch.nn.Linear(3, 3)


@pytest.mark.parametrize(
    "unwritable",
    [
        lambda: {"b": _inference_zeros(4)},  # made under torch.inference_mode
        lambda: {"c": torch.zeros(1).expand(3)},  # every element one memory location
        lambda: {"m": _inference_linear()},  # a module's parameters, the same
        lambda: {"c": torch.zeros(3).to_sparse()},  # not dense
    ],
    ids=["inference-tensor", "expanded-view", "inference-module", "sparse"],
)
def test_a_live_tensor_that_cannot_be_written_is_refused_before_anything_is_applied(
    store: Path, unwritable
):
    """``copy_`` refuses some live tensors (inference tensors outside inference mode,
    views whose elements share memory). Found only while applying, the restore had
    already loaded every entry before it: the state was left half restored, when a
    restore either applies a whole generation or leaves the state untouched."""
    torch.manual_seed(0)
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(
            1,
            {
                "a": torch.nn.Linear(3, 3),
                "b": torch.ones(4),
                "c": torch.ones(3),
                "m": torch.nn.Linear(3, 3),
                "z": torch.ones(2),
            },
        )
    torch.manual_seed(1)
    live: dict[str, Any] = {
        "a": torch.nn.Linear(3, 3),
        "b": torch.zeros(4),
        "c": torch.zeros(3),
        "m": torch.nn.Linear(3, 3),
        "z": torch.zeros(2),
    }
    live.update(unwritable())
    before = {k: v.clone() for k, v in live["a"].state_dict().items()}
    with (
        cv.CheckpointManager(store, run_id="r") as mgr,
        pytest.raises(StateMismatchError, match="cannot be written in place"),
    ):
        mgr.restore(live)
    assert all(torch.equal(live["a"].state_dict()[k], v) for k, v in before.items())
    assert not live["z"].any()
    # strict=False loads everything else and says what it left out.
    with cv.CheckpointManager(store, run_id="r") as mgr:
        info = mgr.restore(live, strict=False)
    assert info is not None and any("cannot be written in place" in m for m in info.mismatched)
    assert live["z"].all()


# -- S3 listing: what other keys cost ---------------------------------------------------


def test_s3_ls_reads_no_more_keys_than_listing_each_generation_would(s3_bucket, monkeypatch):
    """``ls`` cuts every generation's entries out of one listing of all of ``data/``.
    Keys under ``data/`` that belong to no listed generation (planted by the million,
    or at a bucket's root another application's objects) were all listed and held:
    ``ls`` cost grew with them, without bound. Past what listing each generation
    alone costs (17 listings of up to 1,000 keys each), it lists each generation
    alone instead: the same entries, the same verdicts."""
    url = f"s3://{s3_bucket}/p"
    torch.manual_seed(0)
    with cv.CheckpointManager(url, run_id="r", catalog=False, metrics=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.randn(8)})
    client = s3_client(os.environ["AWS_ENDPOINT_URL"])

    def plant(index: int) -> None:
        client.put_object(Bucket=s3_bucket, Key=f"p/data/other/{index:05d}", Body=b"x")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(plant, range(300)))
    store = S3Store(url)
    refs = store.list_generations()
    one_by_one = {ref.name: store.list_entries(ref) for ref in refs}
    # The budget scaled down (17,000 keys a generation) to what a test can plant.
    monkeypatch.setattr(s3_module, "BULK_LISTING_KEYS_PER_GENERATION", 50)
    consumed: Counter[str] = Counter()
    listing = S3Client.list_objects

    def counted(self, prefix):
        for item in listing(self, prefix):
            consumed[prefix] += 1
            yield item

    monkeypatch.setattr(S3Client, "list_objects", counted)
    assert store.list_entries_of(refs) == one_by_one
    assert consumed["p/data/"] <= 2 * 50 + 1
