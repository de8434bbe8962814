"""Issue 23, item 4: the DCP plugin's rollback floor.

After three signed saves, moving the two newest generations out of the store made
``cv.dcp.StorageReader(trusted_keys=..., max_fallback=0)`` silently load the oldest:
the plugin kept no ledger. With ``ledger=`` the writer records every publish in the
manager's published table and the reader checks it (a vanished generation is a
candidate that fails, counted by ``max_fallback``), applies the floor, refuses an
explicit older step below a newer generation that verifies, and raises the floor to
what it read. Without ``ledger=`` nothing changes (docs/security.md).
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptvault as cv
from ckptvault.errors import RollbackError, UsageError
from ckptvault.trust.ledger import Ledger
from ckptvault.trust.signing import generate_keypair

RUN = "dcp-floor"
warnings.filterwarnings("ignore", message=r"torch\.distributed is disabled")


def state(step: int) -> dict[str, Any]:
    return {"model": {"w": torch.arange(12, dtype=torch.float32) * step}}


def zeros() -> dict[str, Any]:
    return {"model": {"w": torch.zeros(12)}}


@pytest.fixture
def signed(store: Path, tmp_path: Path) -> dict[str, Any]:
    """Three signed saves (steps 1, 2, 3) recorded in a ledger; the reader's options."""
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    ledger = tmp_path / "control" / "ledger.sqlite3"
    for step in (1, 2, 3):
        writer = cv.dcp.StorageWriter(
            store, run_id=RUN, step=step, signing_key=tmp_path / "k.pem", ledger=ledger
        )
        dcp.save(state(step), storage_writer=writer)
    return {"run_id": RUN, "trusted_keys": [tmp_path / "k.pub"], "ledger": ledger}


def generations(store: Path) -> dict[int, Path]:
    return {int(p.name[5:17]): p for p in store.glob("step-*")}


def load(store: Path, **options: Any) -> tuple[cv.dcp.StorageReader, dict[str, Any]]:
    live = zeros()
    reader = cv.dcp.StorageReader(store, **options)
    with cv.dcp.typed_errors():
        dcp.load(live, storage_reader=reader)
    return reader, live


def test_hiding_the_two_newest_generations_is_refused_not_a_silent_rollback(
    store, signed, tmp_path
):
    paths = generations(store)
    for step in (3, 2):
        shutil.move(paths[step], tmp_path / paths[step].name)
    with pytest.raises(RollbackError, match="max_fallback=0") as raised:
        cv.dcp.StorageReader(store, max_fallback=0, **signed)
    assert [(step, reason.split(":")[0]) for _, step, reason in raised.value.rejected] == [
        (3, "generation-missing")
    ]
    # A wider bound loads step 1 and says what it skipped; without the ledger the
    # plugin cannot know (and loads the oldest: the README says so).
    reader, live = load(store, max_fallback=2, **signed)
    assert reader.step == 1 and [s.step for s in reader.skipped] == [3, 2]
    assert torch.equal(live["model"]["w"], state(1)["model"]["w"])
    unprotected = {k: v for k, v in signed.items() if k != "ledger"}
    assert cv.dcp.StorageReader(store, max_fallback=0, **unprotected).step == 1


def test_a_load_raises_the_floor_and_an_older_generation_is_then_refused(store, signed, tmp_path):
    reader, live = load(store, **signed)
    assert reader.step == 3 and torch.equal(live["model"]["w"], state(3)["model"]["w"])
    assert Ledger(signed["ledger"]).floor(RUN).step == 3
    entries = [
        json.loads(x) for x in (tmp_path / "control" / "audit.jsonl").read_text().splitlines()
    ]
    assert [e["event"] for e in entries] == ["save", "save", "save", "restore"]
    paths = generations(store)
    shutil.move(paths[3], tmp_path / paths[3].name)
    with pytest.raises(RollbackError):
        cv.dcp.StorageReader(store, **signed)


def test_an_explicit_older_step_is_a_rollback_unless_allowed(store, signed, tmp_path):
    with pytest.raises(RollbackError, match="allow_rollback_to=1"):
        cv.dcp.StorageReader(store, step=1, **signed)
    reader, live = load(store, allow_rollback_to=1, **signed)
    assert reader.step == 1 and reader.rolled_back_from == 3
    assert torch.equal(live["model"]["w"], state(1)["model"]["w"])
    assert Ledger(signed["ledger"]).floor(RUN).step == 1
    entries = [
        json.loads(x) for x in (tmp_path / "control" / "audit.jsonl").read_text().splitlines()
    ]
    (rollback,) = [e for e in entries if e["event"] == "rollback_allowed"]
    assert (rollback["from_step"], rollback["step"]) == (3, 1)
    # Steps 2 and 3 are abandoned now: the newest the reader takes is step 1.
    assert cv.dcp.StorageReader(store, **signed).step == 1


def test_a_save_after_a_rollback_is_not_abandoned_by_it(store, signed, tmp_path):
    load(store, allow_rollback_to=1, **signed)
    writer = cv.dcp.StorageWriter(
        store, run_id=RUN, step=2, signing_key=tmp_path / "k.pem", ledger=signed["ledger"]
    )
    dcp.save(state(20), storage_writer=writer)
    reader, live = load(store, **signed)
    assert reader.step == 2 and reader.generation_id == writer.published.generation_id
    assert torch.equal(live["model"]["w"], state(20)["model"]["w"])


def test_the_control_plane_stays_out_of_the_store(store, tmp_path):
    with pytest.raises(UsageError, match="inside the checkpoint store"):
        cv.dcp.StorageWriter(store, run_id=RUN, step=1, ledger=store / "ledger.sqlite3")
    with pytest.raises(UsageError, match="audit_log= needs ledger="):
        cv.dcp.StorageWriter(store, run_id=RUN, step=1, audit_log=tmp_path / "audit.jsonl")
