"""``should_save(step)`` on 2 real gloo ranks whose clocks and step times differ
(``save_policy_worker.py``): the ranks always agree, the time rule's answer is rank
0's, and an answer from rank 0 that is not true or false is refused on every rank."""

from __future__ import annotations

from pathlib import Path

from support.multirank import launch

WORKER = Path(__file__).resolve().parents[1] / "support" / "save_policy_worker.py"


def ok(codes: list[int], reports: list[dict]) -> list[dict]:
    assert codes == [0, 0], [r.get("log", "")[-2000:] for r in reports]
    return reports


def test_ranks_with_different_clocks_make_the_same_save_decisions(tmp_path: Path):
    zero, one = ok(*launch("agree", tmp_path / "store", 2, tmp_path / "out", worker=WORKER))
    assert zero["decisions"] == one["decisions"]
    saved = [step for step, due in enumerate(zero["decisions"], start=1) if due]
    # Step 1: rank 0's clock passed the 1 s rule (it slept 1.2 s); steps 4 and 8: the
    # step rule. Rank 1's own clock had not reached the time rule at step 1.
    assert saved[0] == 1 and {4, 8} <= set(saved)
    assert one["alone"][0] is False
    assert zero["generations"] == one["generations"] == saved


def test_an_answer_that_is_not_true_or_false_is_refused_on_every_rank(tmp_path: Path):
    zero, one = ok(*launch("dishonest", tmp_path / "store", 2, tmp_path / "out", worker=WORKER))
    for report in (zero, one):
        kind, message = report["error"]
        assert kind == "PeerMessageError"
        assert "not true or false" in message and "'yes'" in message
