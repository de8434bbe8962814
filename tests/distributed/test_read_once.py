"""Read-once restores: each byte several ranks need is read by one of them.

Four gloo ranks restore DDP-like state (plain tensors every rank holds) and an
HSDP-like weight (replicated over one mesh dimension, sharded over the other); see
``read_once_worker.py``. What a user relies on: the state comes back bit for bit;
the job reads the checkpoint about once in all, not once per rank (bytes read, from
``/proc/self/io``); a corrupt chunk read by the one rank that sends it makes every
rank fall back together to the same older generation; and a rank that sends bytes
other than what it read is caught by the ranks that receive them.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from support.multirank import launch

WORKER = Path(__file__).resolve().parents[1] / "support" / "read_once_worker.py"
WORLD = 4


def ok(codes: list[int], reports: list[dict]) -> list[dict]:
    assert codes == [0] * len(codes), [r.get("log", "")[-2000:] for r in reports]
    return reports


@pytest.fixture(scope="module")
def ddp_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Steps 1 and 2 of the replicated state, saved by 4 ranks."""
    root = tmp_path_factory.mktemp("read_once")
    ok(*launch("save", root / "store", WORLD, root / "save", worker=WORKER))
    return root / "store"


def copy_of(store: Path, tmp_path: Path) -> Path:
    target = tmp_path / "store"
    shutil.copytree(store, target, symlinks=True)
    for path in target.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)
    return target


def test_four_ranks_restore_bit_exactly_reading_the_checkpoint_about_once(ddp_store, tmp_path):
    reports = ok(*launch("restore", ddp_store, WORLD, tmp_path, worker=WORKER))
    size = reports[0]["once"]["bytes"]
    for report in reports:
        for way in ("alone", "once"):
            assert report[way]["step"] == 2 and report[way]["exact"], report[way]
            assert report[way]["meta"] == {"step": 2}
    alone = sum(report["alone"]["read"] for report in reports)
    once = sum(report["once"]["read"] for report in reports)
    # Every rank reading alone reads the replicated tensors once per rank; shared
    # out, the job reads them once (plus manifests and indexes).
    assert alone > 3 * size
    assert once <= 1.1 * size, [report["once"]["read"] for report in reports]
    # And the reading is spread over the ranks, not left to one.
    assert all(report["once"]["read"] > size / (2 * WORLD) for report in reports)


def test_a_corrupt_chunk_read_by_the_rank_that_sends_it_makes_every_rank_fall_back(
    ddp_store, tmp_path
):
    store = copy_of(ddp_store, tmp_path)
    newest = sorted(store.glob("step-*"))[-1]
    data = newest / "r00000-000.safetensors"  # the replicated tensors live here
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    reports = ok(*launch("restore_shared", store, WORLD, tmp_path / "out", worker=WORKER))
    for report in reports:
        once = report["once"]
        assert once["step"] == 1 and once["exact"], once  # the same step on every rank
        assert [step for step, _reason in once["skipped"]] == [2]
    reason = reports[0]["once"]["skipped"][0][1]
    # One rank read the chunk from the store and found it changed; the others refused
    # the bytes it sent them, each against its own manifest digest.
    [reader] = re.findall(r"rank (\d): [^;]*the file changed after it was written", reason)
    assert reason.count(f"sent by rank {reader}, do not match") == WORLD - 1, reason


def test_a_rank_that_sends_other_bytes_than_it_read_is_refused_by_every_receiver(
    ddp_store, tmp_path
):
    reports = ok(*launch("restore_dishonest", ddp_store, WORLD, tmp_path, worker=WORKER))
    for report in reports:
        kind, message = report["once"]["error"]
        assert kind == "NoValidCheckpoint", message
        assert "sent by rank 1" in message
        assert report["once"]["untouched"]
