"""Each drill fails when the protection it drills is switched off.

These tests disable one protection on purpose (the only monkeypatching in the drill
tests) and show that the drill then reports ``passed=False``: a drill that passes
whatever the code does would prove nothing. The crash drills run child processes:
there the protection is switched off in the child, by a ``sitecustomize`` module
on its ``PYTHONPATH``.
"""

from __future__ import annotations

import dataclasses
import textwrap
from pathlib import Path

import pytest

from ckptvault.ops.drills import DrillContext, DrillResult, choose_drills, synthetic_context


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> DrillContext:
    return synthetic_context(tmp_path_factory.mktemp("drills"))


def run(context: DrillContext, name: str, tmp_path: Path) -> DrillResult:
    """One drill in a scratch space of its own (drills reuse their labels)."""
    own = dataclasses.replace(context, scratch=tmp_path)
    (result,) = [drill.run(own) for drill in choose_drills([name])]
    return result


def test_every_drill_passes_with_its_protection(context: DrillContext, tmp_path: Path) -> None:
    names = ["truncated-file", "flipped-byte", "missing-file", "extra-pickle", "other-run"]
    names += ["format-version", "rollback", "key-destroyed", "remote-tier-only"]
    for name in names:
        result = run(context, name, tmp_path / name)
        assert result.passed is True, result


def _without_codes(monkeypatch: pytest.MonkeyPatch, code: str) -> None:
    from ckptvault.trust import checks

    original = checks._check_file_set
    monkeypatch.setattr(
        checks, "_check_file_set", lambda m, e: [p for p in original(m, e) if p.code != code]
    )


def test_truncated_file_fails_without_the_size_check(context, tmp_path, monkeypatch) -> None:
    _without_codes(monkeypatch, "size-mismatch")
    assert run(context, "truncated-file", tmp_path).passed is False


def test_missing_file_fails_without_the_file_set_check(context, tmp_path, monkeypatch) -> None:
    _without_codes(monkeypatch, "file-missing")
    assert run(context, "missing-file", tmp_path).passed is False


def test_flipped_byte_fails_when_digests_accept_anything(context, tmp_path, monkeypatch) -> None:
    from ckptvault.trust.digests import ChunkVerifier

    monkeypatch.setattr(ChunkVerifier, "_compare_closed_chunks", lambda self: None)
    monkeypatch.setattr(ChunkVerifier, "finish", lambda self: None)
    assert run(context, "flipped-byte", tmp_path).passed is False


def test_extra_pickle_fails_without_the_pickle_refusal(context, tmp_path, monkeypatch) -> None:
    from ckptvault.trust import checks

    monkeypatch.setattr(checks, "PICKLE_SUFFIXES", ())
    assert run(context, "extra-pickle", tmp_path).passed is False


def test_extra_pickle_fails_when_the_pickle_is_loaded(context, tmp_path, monkeypatch) -> None:
    import pickle  # the disabled protection: a loader that unpickles what it finds

    from ckptvault.trust import checks

    original = checks._check_entries

    def loading(entries):  # type: ignore[no-untyped-def]
        for generation in (tmp_path / "extra-pickle" / "store").iterdir():
            for planted in generation.glob("*.pkl"):
                pickle.loads(planted.read_bytes())
        return original(entries)

    monkeypatch.setattr(checks, "_check_entries", loading)
    result = run(context, "extra-pickle", tmp_path)
    assert result.passed is False and "WAS LOADED" in result.observed


def test_other_run_fails_when_any_run_id_is_accepted(context, tmp_path, monkeypatch) -> None:
    from ckptvault.trust import checks

    original = checks._check_identity
    monkeypatch.setattr(
        checks,
        "_check_identity",
        lambda ref, manifest, policy: original(
            ref, manifest, dataclasses.replace(policy, run_id=None)
        ),
    )
    assert run(context, "other-run", tmp_path).passed is False


def test_format_version_fails_when_any_version_is_read(context, tmp_path, monkeypatch) -> None:
    from ckptvault.format import manifest

    newer = max(manifest.READABLE_FORMAT_VERSIONS) + 1  # the version the drill writes
    monkeypatch.setattr(
        manifest, "READABLE_FORMAT_VERSIONS", manifest.READABLE_FORMAT_VERSIONS | {newer}
    )
    assert run(context, "format-version", tmp_path).passed is False


def test_rollback_fails_without_the_floor(context, tmp_path, monkeypatch) -> None:
    from ckptvault.trust.ledger import RestoreFloor

    monkeypatch.setattr(RestoreFloor, "refuses", lambda self, step, generation_id: None)
    assert run(context, "rollback", tmp_path).passed is False


def test_key_destroyed_fails_when_destroy_erases_nothing(context, tmp_path, monkeypatch) -> None:
    from ckptvault.trust.keystore import LocalKeyStore

    monkeypatch.setattr(LocalKeyStore, "destroy", lambda self, run_id: None)
    assert run(context, "key-destroyed", tmp_path).passed is False


def test_remote_tier_fails_when_restore_ignores_it(context, tmp_path, monkeypatch) -> None:
    from ckptvault.restoring.restorer import Restorer

    original = Restorer.__init__

    def local_only(
        self,
        run,
        threads,
        contract_fields,
        max_fallback=None,
        remote_tiers=(),
        on_remote_restore=None,
    ):  # type: ignore[no-untyped-def]
        original(self, run, threads, contract_fields, max_fallback, (), on_remote_restore)

    monkeypatch.setattr(Restorer, "__init__", local_only)
    assert run(context, "remote-tier-only", tmp_path).passed is False


def test_storage_full_fails_without_typed_errors(context, tmp_path, monkeypatch) -> None:
    from ckptvault.storage.posix import files as posix_files
    from ckptvault.storage.posix.store import PosixStore

    assert run(context, "storage-full", tmp_path / "with").passed in (True, None)
    monkeypatch.setattr(PosixStore, "check_capacity", lambda self, nbytes, nfiles: None)
    monkeypatch.setattr(posix_files, "_FULL_ERRNOS", frozenset())
    result = run(context, "storage-full", tmp_path / "without")
    if result.passed is None:
        pytest.skip(result.skipped or "storage-full cannot run here")
    assert result.passed is False


@pytest.mark.parametrize("broken", ["async", "backpressure"])
def test_slow_storage_fails_without_async_or_backpressure(
    context, tmp_path, monkeypatch, broken
) -> None:
    from ckptvault.saving.scheduler import SaveScheduler

    if broken == "async":
        original = SaveScheduler.submit
        monkeypatch.setattr(
            SaveScheduler,
            "submit",
            lambda self, step, captured, blocking, started, metrics=None: original(
                self, step, captured, True, started, metrics
            ),
        )
    else:
        monkeypatch.setattr(SaveScheduler, "_make_room", lambda self, step: True)
    assert run(context, "slow-storage", tmp_path).passed is False


NON_ATOMIC_PUBLISH = """
import os
import time
from ckptvault.format.layout import generation_dirname, parse_generation_dirname
from ckptvault.saving import generation_writer
from ckptvault.storage.posix import publish as posix_publish
from ckptvault.storage.base import GenerationRef, write_new_file

steps = {}
write = generation_writer.GenerationWriter.write

def remembering_write(self, step, *args, **kwargs):
    steps["step"] = step
    return write(self, step, *args, **kwargs)

begin = posix_publish.PosixStagingArea.__init__

def in_place(self, store, generation_id, joined=False):
    # No staging: the generation is visible under its final name while written.
    begin(self, store, generation_id, joined)
    root = store.open_root()
    final = generation_dirname(steps["step"], generation_id)
    os.rename(generation_id, final, src_dir_fd=self.staging_fd, dst_dir_fd=root)
    os.close(root)
    # Visible and still empty for a while: the drill's kill (a tenth of a save's
    # duration after it began) lands here, not before or after the save.
    time.sleep(1.5)

def publish(self, area, step, manifest, signature):
    write_new_file(area, "manifest.json", manifest)
    if signature is not None:
        write_new_file(area, "manifest.sig", signature)
    final = generation_dirname(step, area.generation_id)
    return GenerationRef(parse_generation_dirname(final), os.path.join(area.store.location, final))

generation_writer.GenerationWriter.write = remembering_write
posix_publish.PosixStagingArea.__init__ = in_place
posix_publish.AtomicRename.publish = publish
"""

NO_RESTARTS = """
from ckptvault.ops import supervise

def never_restart(outcome, **kwargs):
    return supervise.Decision(supervise.Action.STOP, "failure", 1, reason="restarts disabled")

supervise.decide = never_restart
"""


def _in_children(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, code: str) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(textwrap.dedent(code))
    monkeypatch.setenv("PYTHONPATH", str(site))


def test_sigkill_fails_without_atomic_publish(context, tmp_path, monkeypatch) -> None:
    _in_children(monkeypatch, tmp_path, NON_ATOMIC_PUBLISH)
    result = run(context, "sigkill-mid-save", tmp_path)
    assert result.passed is False, result
    assert "after skipping step" in result.observed  # the half-written save was visible


def test_supervised_restart_fails_without_restarts(context, tmp_path, monkeypatch) -> None:
    _in_children(monkeypatch, tmp_path, NO_RESTARTS)
    result = run(context, "supervised-restart", tmp_path)
    assert result.passed is False, result
    assert "1 attempt" in result.observed


def test_node_loss_passes_and_fails_when_restore_passes_over_memory(
    context, tmp_path, monkeypatch
) -> None:
    result = run(context, "node-loss", tmp_path / "with")
    assert result.passed is True, result
    assert result.timings["memory_recovery"] > 0 and result.timings["store_recovery"] > 0
    from ckptvault.restoring import restorer

    original = restorer.Restorer.__init__

    def without_memory(self, *args, memory_tiers=(), **kwargs):  # type: ignore[no-untyped-def]
        original(self, *args, **kwargs)

    monkeypatch.setattr(restorer.Restorer, "__init__", without_memory)
    assert run(context, "node-loss", tmp_path / "without").passed is False
