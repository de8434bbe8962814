"""Progress callbacks of the library's long operations: ``progress(done, total)`` from
(0, total) up to (total, total), per block or item; a callback that raises stops the
work and is never mistaken for a damaged checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.ops.export import consolidate_weights, export_weights
from ckptvault.progress import ProgressCallbackError
from ckptvault.replication.replicator import copy_generation
from ckptvault.retention.collector import GarbageCollector
from ckptvault.storage import open_store
from ckptvault.trust.checks import verify_generation
from ckptvault.trust.context import TrustContext

CHUNK = 64 * 1024  # small chunks: several progress calls for small tensors


def _state(step: int) -> dict:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(256, 256), "b": torch.randn(256)}}


@pytest.fixture
def store(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    with cv.CheckpointManager(path, run_id="r", chunk_size=CHUNK) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, _state(step))
    return path


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []

    def __call__(self, done: int, total: int) -> None:
        self.calls.append((done, total))

    def assert_complete(self, total: int, at_least: int = 2) -> None:
        """Rising from 0 to ``total``, with one total throughout."""
        assert len(self.calls) >= at_least, self.calls
        assert self.calls[0] == (0, total) and self.calls[-1] == (total, total)
        assert {t for _, t in self.calls} == {total}
        dones = [done for done, _ in self.calls]
        assert dones == sorted(dones)


def test_verify_reports_the_bytes_hashed(store: Path):
    source = open_store(store)
    ref = source.list_generations()[0]
    progress = Recorder()
    report = verify_generation(source, ref, progress=progress)
    assert report.ok and report.manifest is not None
    # 256 KiB of weights in 64 KiB chunks: a call per block, not one at the end.
    progress.assert_complete(report.manifest.total_bytes, at_least=4)


def test_export_and_consolidate_report_the_tensor_bytes(store: Path, tmp_path: Path):
    tensor_bytes = (256 * 256 + 256) * 4
    progress = Recorder()
    result = export_weights(store, 3, tmp_path / "w.safetensors", progress=progress)
    assert result.bytes >= tensor_bytes
    progress.assert_complete(tensor_bytes, at_least=3)
    progress = Recorder()
    consolidate_weights(store, tmp_path / "hf", prefix="model/", progress=progress)
    progress.assert_complete(tensor_bytes, at_least=3)


def test_replication_reports_the_bytes_copied(store: Path, tmp_path: Path):
    source = open_store(store)
    ref = source.list_generations()[0]
    (tmp_path / "durable").mkdir()
    target = open_store(tmp_path / "durable")
    progress = Recorder()
    copied = copy_generation(source, ref, target, progress=progress)
    manifest = verify_generation(target, copied).manifest
    assert manifest is not None
    progress.assert_complete(manifest.total_bytes, at_least=4)
    # An existing copy is left alone: nothing copied, nothing reported.
    again = Recorder()
    copy_generation(source, ref, target, progress=again)
    assert again.calls == []


def test_gc_reports_verification_bytes_and_each_deletion(store: Path):
    source = open_store(store)
    retention = cv.Retention(keep_last=1, delete_delay=0)
    collector = GarbageCollector(
        [source],
        retention.rules,
        retention.delete_delay,
        policy=TrustContext().policy(None, None),
        run_id="r",
    )
    verified = Recorder()
    newest = collector.verify_newest(progress=verified)
    assert newest is not None and newest.ok and newest.manifest is not None
    verified.assert_complete(newest.manifest.total_bytes)
    applied = Recorder()
    result = collector.apply(collector.plan(), progress=applied)
    done = len(result.marked) + len(result.unmarked) + len(result.deleted)
    assert 1 in [d.step for d in result.deleted] and done >= 1
    assert applied.calls == [(n, done) for n in range(done + 1)]  # one call per decision
    assert 1 not in [ref.step for ref in source.list_generations()]


def test_a_failing_callback_stops_verify_and_is_not_a_bad_file(store: Path):
    """An OSError from the callback is not "cannot read the file": the caller hears it."""
    source = open_store(store)
    ref = source.list_generations()[0]

    def broken(done: int, total: int) -> None:
        if done:
            raise OSError("the terminal went away")

    with pytest.raises(ProgressCallbackError, match="OSError: the terminal went away") as caught:
        verify_generation(source, ref, progress=broken)
    assert isinstance(caught.value.__cause__, OSError)
    assert verify_generation(source, ref).ok  # the generation itself is fine


def test_a_failing_callback_stops_gc_and_is_not_a_failed_deletion(store: Path):
    source = open_store(store)
    retention = cv.Retention(keep_last=1, delete_delay=0)
    collector = GarbageCollector(
        [source], retention.rules, 0, policy=TrustContext().policy(None, None)
    )
    collector.verify_newest()

    def broken(done: int, total: int) -> None:
        if done:
            raise cv.errors.CheckpointError("bar broke")

    with pytest.raises(ProgressCallbackError):
        collector.apply(collector.plan(), progress=broken)
