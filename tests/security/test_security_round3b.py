"""Issue 23, item 5, second pass: attacks on what items 2-4 built (an explicit step is a
rollback, pointers and paths are hints; no pickle between ranks; the DCP plugin's
ledger), by someone who can write the store, one tier of it, a trainer's output
directory, or one rank of the job. Each test performs the attack:

- a directory planted in the store (or the replica tier) during an allowed rollback,
  under a huge step and the id of the generation rolled back to, got that id into
  the ledger's abandoned list, which matched ids alone: the genuine generation was
  refused for good (and retention counted it abandoned);
- a newer generation saved on a node whose clock ran ahead, hidden during an allowed
  rollback and put back, sorted after the rollback's cutoff: the next restore took
  it, undoing the rollback silently (the ledger had recorded its publish);
- ``CkptvaultTrainer.train(resume_from_checkpoint=True)`` started fresh whenever the
  manager listed no unmarked generation: deletion marks planted on every generation
  (which restore, with a ledger, ignores) or an emptied local tier beside a full
  replica made the run start over from step 0;
- one rank's save plan of thousands of column chunks of one tensor kept rank 0 in
  DCP's overlap check for hours, past every collective's timeout;
- an all-gather brought every rank every rank's message padded to the longest, with
  no bound on the total (a gather has one); and the preemption all-gather took any
  truthy JSON value for a signal.
"""

from __future__ import annotations

import shutil
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import ckptvault as cv
import ckptvault.saving.generation_writer as generation_writer
from ckptvault.distributed.plan_wire import MAX_LOCAL_CHUNKS, plan_from_json
from ckptvault.errors import PeerMessageError
from ckptvault.format.layout import generation_dirname, new_generation_id
from ckptvault.storage import open_store
from ckptvault.storage.records import DELETION_MARK
from ckptvault.trust.ledger import Ledger
from support.multirank import launch


def weights(step: float) -> dict:
    return {"w": torch.full((4,), float(step))}


def ids_by_step(store: Path) -> dict[int, str]:
    return {ref.step: ref.generation_id for ref in open_store(store).list_generations()}


# -- the ledger's abandoned list -----------------------------------------------------------


def test_a_name_planted_in_the_replica_during_a_rollback_abandons_no_genuine_generation(
    tmp_path,
):
    """The replica tier's writer removes its copy of step 1 and plants an empty
    directory named step 9999 with step 1's id while the operator rolls back to step 1.
    Before the fix, step 1 itself was abandoned: the next restore (and every
    allow_rollback_to=1) refused everything."""
    store, replica, ledger = tmp_path / "store", tmp_path / "replica", tmp_path / "c" / "l.db"
    options = {"run_id": "r", "ledger": ledger, "replicate_to": replica}
    with cv.CheckpointManager(store, **options) as mgr:  # type: ignore[arg-type]
        for step in (1, 2):
            mgr.save(step, weights(step))
    first = ids_by_step(store)[1]
    shutil.rmtree(replica / generation_dirname(1, first))
    planted = replica / generation_dirname(9999, first)
    planted.mkdir()
    with cv.CheckpointManager(store, **options) as mgr:  # type: ignore[arg-type]
        assert mgr.restore(weights(0), allow_rollback_to=1).step == 1
    planted.rmdir()
    assert Ledger(ledger).floor("r").refuses(1, first) is None
    with cv.CheckpointManager(store, **options) as mgr:  # type: ignore[arg-type]
        live = weights(0)
        assert mgr.restore(live).step == 1  # step 2 stays abandoned, step 1 does not
        assert torch.equal(live["w"], torch.ones(4))


def test_a_name_planted_during_a_dcp_plugin_rollback_abandons_no_genuine_generation(tmp_path):
    store, ledger = tmp_path / "store", tmp_path / "c" / "l.db"
    for step in (1, 2):
        writer = cv.dcp.StorageWriter(store, run_id="r", step=step, ledger=ledger)
        dcp.save(weights(step), storage_writer=writer)
    first = ids_by_step(store)[1]
    planted = store / generation_dirname(9999, first)
    planted.mkdir()
    reader = cv.dcp.StorageReader(store, run_id="r", ledger=ledger, allow_rollback_to=1)
    dcp.load(weights(0), storage_reader=reader)
    planted.rmdir()
    live = weights(0)
    reader = cv.dcp.StorageReader(store, run_id="r", ledger=ledger)
    dcp.load(live, storage_reader=reader)
    assert reader.step == 1 and torch.equal(live["w"], torch.ones(4))


# -- the rollback's cutoff -------------------------------------------------------------------


def test_a_hidden_generation_from_a_node_whose_clock_ran_ahead_stays_abandoned(
    tmp_path, monkeypatch
):
    """Steps 1-3 are saved on a node whose clock is an hour ahead; the store's writer
    hides step 3 while the operator, on a node with the right time, rolls back to
    step 1 (same ledger, on a shared file system); the run saves step 2 again; step 3
    is put back. Before the fix the next restore took step 3."""
    store, ledger = tmp_path / "store", tmp_path / "c" / "l.db"

    def ahead(not_before: str | None = None) -> str:
        return new_generation_id(datetime.now(timezone.utc) + timedelta(hours=1), not_before)

    with monkeypatch.context() as patched:
        patched.setattr(generation_writer, "new_generation_id", ahead)
        with cv.CheckpointManager(store, run_id="r", ledger=ledger) as mgr:
            for step in (1, 2, 3):
                mgr.save(step, weights(step))
    third = store / generation_dirname(3, ids_by_step(store)[3])
    third.rename(tmp_path / "hidden")
    with cv.CheckpointManager(store, run_id="r", ledger=ledger) as mgr:
        assert mgr.restore(weights(0), allow_rollback_to=1).step == 1
        mgr.save(2, weights(22))
    (tmp_path / "hidden").rename(third)
    with cv.CheckpointManager(store, run_id="r", ledger=ledger) as mgr:
        live = weights(0)
        info = mgr.restore(live)
    assert (info.step, live["w"][0].item()) == (2, 22.0)
    assert [(s.step, s.reason.split(":")[0]) for s in info.skipped] == [(3, "rollback")]


# -- Hugging Face: resume_from_checkpoint=True -----------------------------------------------


def _trainer(root: Path, manager: cv.CheckpointManager):  # type: ignore[no-untyped-def]
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed

    from ckptvault.integrations.huggingface import CkptvaultTrainer

    set_seed(0)
    config = GPT2Config(n_layer=1, n_embd=8, n_head=2, vocab_size=16, n_positions=8)
    tokens = torch.randint(0, 16, (8, 8), generator=torch.Generator().manual_seed(1))
    args = TrainingArguments(
        str(root / "out"),
        max_steps=4,
        save_steps=2,
        per_device_train_batch_size=2,
        use_cpu=True,
        report_to="none",
        disable_tqdm=True,
    )
    return CkptvaultTrainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
        checkpoint_manager=manager,
    )


def test_hf_resume_is_no_fresh_start_under_marks_planted_on_every_generation(tmp_path):
    pytest.importorskip("transformers")
    options = {"run_id": "hf", "ledger": tmp_path / "c" / "l.db"}
    with cv.CheckpointManager(tmp_path / "store", **options) as mgr:  # type: ignore[arg-type]
        _trainer(tmp_path, mgr).train()
    store = open_store(tmp_path / "store")
    for ref in store.list_generations():  # the store's writer marks every generation
        mark = {"marked_at": "2020-01-01T00:00:00.000000Z", "reason": "planted"}
        store.put_record(DELETION_MARK, ref.name.dirname, mark)
    with cv.CheckpointManager(tmp_path / "store", **options) as mgr:  # type: ignore[arg-type]
        trainer = _trainer(tmp_path, mgr)
        trainer.train(resume_from_checkpoint=True)
    assert trainer.restore_info is not None and trainer.restore_info.step == 4


def test_hf_resume_reads_the_replica_when_the_local_tier_was_emptied(tmp_path):
    pytest.importorskip("transformers")
    options = {"run_id": "hf", "replicate_to": tmp_path / "replica"}
    with cv.CheckpointManager(tmp_path / "store", **options) as mgr:  # type: ignore[arg-type]
        _trainer(tmp_path, mgr).train()
    for entry in (tmp_path / "store").iterdir():
        if entry.name.startswith("step-"):
            shutil.rmtree(entry)
    with cv.CheckpointManager(tmp_path / "store", **options) as mgr:  # type: ignore[arg-type]
        trainer = _trainer(tmp_path, mgr)
        trainer.train(resume_from_checkpoint=True)
    assert trainer.restore_info is not None and trainer.restore_info.step == 4


# -- one rank's messages -----------------------------------------------------------------------


def test_a_plan_of_thousands_of_chunks_of_one_tensor_is_refused_at_once():
    """Rank 1's plan: 4,000 column chunks of one made-up tensor (250 kB of JSON).
    Before the fix it was accepted, and DCP's overlap check then took about 10 s on
    rank 0 (50,000 chunks: most of an hour; the check is quadratic)."""
    n = 4000
    columns = [["e", "shard", "uint8", [n, n], [0, j], [n, 1]] for j in range(n)]
    started = time.perf_counter()
    with pytest.raises(PeerMessageError, match=r"rank 1 sent a save plan .*\(4000 chunks"):
        plan_from_json({"items": columns}, 1)
    assert time.perf_counter() - started < 5
    honest = [["e", "shard", "uint8", [n, n], [0, j], [n, 1]] for j in range(MAX_LOCAL_CHUNKS)]
    assert len(plan_from_json({"items": honest}, 1).items) == MAX_LOCAL_CHUNKS


def test_one_rank_cannot_fake_a_preemption_nor_make_every_rank_receive_too_much(tmp_path):
    worker = Path(__file__).resolve().parents[1] / "support" / "dishonest_worker.py"
    codes, reports = launch("dishonest", tmp_path / "store", 2, tmp_path / "run", worker=worker)
    assert codes == [0, 0], [r.get("log", "")[-3000:] for r in reports]
    for report in reports:
        kind, text = report["preempted"]["error"]
        assert kind == "PeerMessageError" and "rank 1 sent" in text, text
        kind, text = report["oversized"]["error"]
        assert kind == "PeerMessageError" and "rank 1" in text, text
        assert report["after"] == {"value": [0, 1]}  # still in step
