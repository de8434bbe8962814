"""The plan kept across saves, and indexes written by their ranks (issue 27, item 4).

Real gloo jobs (``plan_cache_worker.py``): a save of an unchanged structure reuses
rank 0's plan (``stats.plans_reused``); a changed shape, dtype, a tensor added or
removed, or one rank's own tensor makes every rank plan afresh; every generation
restores bit-exactly and verifies. A rank whose index is not what it announced, or
not what it must hold, or that claims an unchanged plan while its tensor changed,
makes the save fail with a typed error on every rank and publishes nothing; clean
saves go on after it.
"""

from __future__ import annotations

from pathlib import Path

from support.common import run_cli
from support.multirank import launch

WORKER = Path(__file__).resolve().parents[1] / "support" / "plan_cache_worker.py"


def ok(codes: list[int], reports: list[dict]) -> list[dict]:
    assert codes == [0] * len(codes), [r.get("log", "")[-3000:] for r in reports]
    return reports


def test_an_unchanged_structure_reuses_the_plan_and_any_change_replans(tmp_path: Path):
    store = tmp_path / "store"
    reports = ok(*launch("structures", store, 3, tmp_path / "run", worker=WORKER))
    for report in reports:
        # steps 1..9: first save; same; shape; same; dtype; added; removed; one
        # rank's own tensor; same.
        assert report["reused"] == [0, 1, 0, 1, 0, 0, 0, 0, 1], report
        assert report["exact"] == {"2": True, "4": True, "7": True, "9": True}, report
    assert len(list(store.glob("step-*"))) == 9
    assert run_cli("verify", str(store), "--all").returncode == 0


def test_a_rank_whose_index_or_plan_lies_fails_the_save_on_every_rank(tmp_path: Path):
    store = tmp_path / "store"
    reports = ok(*launch("hostile", store, 2, tmp_path / "run", worker=WORKER))
    expected = {
        "other bytes": "is not what the rank announced",
        "other chunks": "exactly the chunks rank 0 planned for it",
        "other digests": "do not derive the file digest",
        "stale digest": "of another size than the plan made it",
        "lying plan": "a plan of another digest than it announced",
    }
    for report in reports:
        for case, words in expected.items():
            error = report[case]
            assert error is not None and error[0] == "SaveFailedError", (case, error)
            assert words in error[1], (case, error)
            if case.startswith("other"):
                assert "rank 1's index" in error[1], (case, error)
        for case in ("other bytes", "other chunks", "other digests"):
            assert report[case + " published"] == [1], (case, report)  # nothing new
        assert report["stale digest published"] == [11, 10, 1]  # newest first
        assert report["clean"] is None
        assert report["reused"][1] is None and report["reused after"] == report["reused"][0] + 1
        assert report["restored"] == 15 and report["exact"]
    assert not list((store / ".staging").iterdir())
    assert run_cli("verify", str(store), "--all").returncode == 0
