"""Host memory for asynchronous staging on 2 real gloo ranks (``staging_worker.py``):
a rank that has none makes every rank refuse together."""

from __future__ import annotations

from pathlib import Path

from support.multirank import launch

WORKER = Path(__file__).resolve().parents[1] / "support" / "staging_worker.py"


def test_a_rank_without_memory_for_staging_makes_every_rank_refuse_together(tmp_path: Path):
    """Rank 1's host has 1 MiB left: the first asynchronous save is refused on both
    ranks at once (not rank 1 alone, leaving rank 0 in the save's collectives until
    its timeout), again at the next one, and a synchronous save still works."""
    codes, reports = launch("small_host", tmp_path / "store", 2, tmp_path / "out", worker=WORKER)
    assert codes == [0, 0], [r.get("log", "")[-2000:] for r in reports]
    zero, one = reports
    for refusal in one["refusals"]:
        assert refusal[0] == "host-memory" and refusal[1] >= 8 * 1024 * 1024
    for refusal in zero["refusals"]:
        assert "another rank's host has no memory" in refusal[2]
    assert len(zero["refusals"]) == len(one["refusals"]) == 2
    assert zero["generations"] == one["generations"] == [3]
