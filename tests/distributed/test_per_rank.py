"""Entries wrapped in ``cv.PerRank``: each rank's own, saved per rank and restored in
place to the same rank; on one process, plain entries (the same code runs on one
rank and on many)."""

from __future__ import annotations

from pathlib import Path

import torch

import ckptvault as cv
from support.multirank import launch


class Cursor:
    def __init__(self, position: int = 0) -> None:
        self.position = position

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


def test_per_rank_entries_save_and_restore_in_place_on_one_process(store: Path):
    with cv.CheckpointManager(store, run_id="job") as manager:
        manager.save(
            1,
            {
                "w": torch.ones(2),
                "cursor": cv.PerRank(Cursor(7)),
                "seen": cv.PerRank({"tokens": 3}),
            },
        )
        cursor, seen = Cursor(), {"tokens": 0}
        live = {"w": torch.zeros(2), "cursor": cv.PerRank(cursor), "seen": cv.PerRank(seen)}
        info = manager.restore(live)
    assert info is not None and info.step == 1
    assert cursor.position == 7 and seen == {"tokens": 3}
    assert live["cursor"].value is cursor and live["seen"].value is seen
    assert torch.equal(live["w"], torch.ones(2))


def test_per_rank_entries_go_back_to_their_own_rank(tmp_path: Path):
    codes, reports = launch("per_rank_entries", tmp_path / "store", 2, tmp_path / "out")
    assert codes == [0, 0], [r.get("log", "")[-2000:] for r in reports]
    for rank, report in enumerate(reports):
        assert report["position"] == 10 + rank
        assert report["seen"] == {"rank": rank}
        assert report["in_place"] is True
