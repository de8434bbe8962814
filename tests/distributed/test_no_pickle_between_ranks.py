"""No rank unpickles another rank's bytes (issue 23, item 3).

A real two-rank gloo job (``poison_worker.py``): rank 1 replaces, in turn, each
message it sends during a save and during a restore with a pickle that would create
a marker file when unpickled. Every poisoned save and restore fails with a typed
error on both ranks, the marker never appears, no ``*_object`` collective (DCP's
pickled ones) is ever called, nothing is published, no state changes, and the job
goes on saving and restoring cleanly afterwards.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from support.multirank import launch

WORKER = Path(__file__).resolve().parents[1] / "support" / "poison_worker.py"

# The collectives of one save (distributed/save.py's phases, DCP's four steps in
# distributed/dcp_save.py) and one restore of one candidate (distributed/restore.py).
SAVE_KINDS = [
    "broadcast",  # phase 1: the generation id
    "all_gather",  # phase 2: every rank joined the staging area
    "gather",  # DCP: local plans (and their digests) to rank 0
    "broadcast",  # rank 0: plan afresh (a first save), or reuse the kept plan
    "scatter",  # DCP: each rank's part of the global plan
    "gather",  # DCP: write results to rank 0
    "broadcast",  # DCP: the verdict
    "all_gather",  # phase 4: state trees, file names, replica digests
    "broadcast",  # phase 5: the outcome of publishing
]
RESTORE_KINDS = [
    "broadcast",  # rank 0: try this candidate
    "all_gather",  # verdict: structure, signature, keys
    "all_gather",  # the manifest bytes every rank checked
    "all_gather",  # verdict: this rank's view of the state
    "all_gather",  # verdict: every rank can read
    "all_gather",  # verdict: load plan made (DCP's steps, each rank alone)
    "all_gather",  # the blocks each rank reads (who reads which shared one)
    "all_gather",  # verdict: tensors read (blocks shared as raw bytes, checked)
    "all_gather",  # verdict: state decoded
    "broadcast",  # rank 0: the choice is done
    "all_gather",  # verdict: every rank's state matched, apply
]
SENDS = ("all_gather", "gather")  # where rank 1's bytes travel (a scatter's and a
# broadcast's travel from rank 0 only)

# What a poisoned save or restore may raise: refused, never timed out or crashed.
REFUSED = {"SaveFailedError", "PeerMessageError"}
PICKLE_REFUSED = re.compile(r"rank 1 sent .* that ckptvault never sends|not valid UTF-8 JSON")


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, list[dict]]:
    root = tmp_path_factory.mktemp("poisoned")
    codes, reports = launch("poison", root / "store", 2, root / "run", timeout=600, worker=WORKER)
    assert codes == [0, 0], [r.get("log", "")[-3000:] for r in reports]
    return root / "store", root / "run", reports


def test_every_collective_of_a_save_and_a_restore_is_counted(poisoned):
    _store, _run, reports = poisoned
    for report in reports:
        assert report["save_kinds"] == SAVE_KINDS
        assert report["restore_kinds"] == RESTORE_KINDS
    rank1 = reports[1]
    # Rank 1 encoded one message per collective in which it sends: all were poisoned.
    assert rank1["save_sent"] == sum(k in SENDS for k in SAVE_KINDS) == 4
    assert rank1["restore_sent"] == sum(k in SENDS for k in RESTORE_KINDS) == 9
    assert len(rank1["saves"]) == 4 and len(rank1["restores"]) == 9


def test_nothing_is_unpickled_and_no_object_collective_runs(poisoned):
    _store, run, reports = poisoned
    assert not (run / "PWNED").exists()
    for report in reports:
        assert report["object_calls"] == []
        assert not report["marker"]
        assert not any(s["marker"] for s in report["saves"] + report["restores"])


def test_every_poisoned_save_fails_typed_on_both_ranks_and_publishes_nothing(poisoned):
    store, _run, reports = poisoned
    for n in range(4):
        errors = [report["saves"][n]["error"] for report in reports]
        assert all(error is not None and error[0] in REFUSED for error in errors), (n, errors)
        assert any(PICKLE_REFUSED.search(error[1]) for error in errors), (n, errors)
        for report in reports:
            assert report["saves"][n]["steps"] == [1]  # nothing new published
    # A clean save afterwards publishes; no poisoned step ever reached the store.
    for report in reports:
        assert report["after_saves"] == [1, 100]
    assert sorted(p.name[5:17] for p in store.glob("step-*")) == ["000000000001", "000000000100"]


def test_every_poisoned_restore_fails_typed_on_both_ranks_and_changes_nothing(poisoned):
    _store, _run, reports = poisoned
    for report in reports:
        assert report["restored_step"] == 100
    for n in range(7):
        errors = [report["restores"][n]["error"] for report in reports]
        assert all(error is not None and error[0] in REFUSED for error in errors), (n, errors)
        assert any(PICKLE_REFUSED.search(error[1]) for error in errors), (n, errors)
        assert all(report["restores"][n]["untouched"] for report in reports)
    for report in reports:
        assert report["after_restores"] == [100, False]  # restored cleanly afterwards


def test_the_dcp_plugins_choice_refuses_a_pickled_or_forged_verdict(tmp_path: Path):
    """``cv.dcp.StorageReader`` agrees on its generation over ckptvault's coordinator:
    a pickle from rank 1, or a verdict of JSON ckptvault never sends (a ``fatal`` that
    is a number), is PeerMessageError on both ranks at once; nothing runs."""
    codes, reports = launch("plugin", tmp_path / "store", 2, tmp_path / "out", worker=WORKER)
    assert codes == [0, 0], reports
    for report in reports:
        assert report["object_calls"] == []
        for choice in report["choices"]:
            assert choice["marker"] is False
            assert choice["error"] is not None and choice["error"][0] == "PeerMessageError"
            assert (
                "rank 1 sent" in choice["error"][1] or "not valid UTF-8 JSON" in choice["error"][1]
            )
