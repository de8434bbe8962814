"""What simulated power loss found, pinned down one part at a time.

- A key store's first key (made during a run's first encrypted save) was written
  and linked durably, but the key store's new directories were not: a power cut
  could take the key back after the generation it unlocks was published.
- A store's first record (a pin, a deletion mark) was renamed into place and its
  directory fsync'd, but ``.records`` and ``.records/<kind>`` were created without
  making them durable: a power cut could take a pin back, and retention would then
  delete the generation the operator pinned.
- A new audit log's name was never made durable, and an append that a crash cut
  short (between the entry reaching the log and the ledger recording its head, or
  half-written) made the log fail ``audit verify`` for ever, as if tampered with.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptvault.storage.posix.store import PosixStore
from ckptvault.storage.records import PIN
from ckptvault.trust.audit import AuditLog
from ckptvault.trust.audit_verify import verify_audit_log
from ckptvault.trust.keystore import LocalKeyStore
from ckptvault.trust.ledger import Ledger
from support.power_loss import Recorder, describe_tree
from support.power_loss_states import crash_states


class Crash(BaseException):
    """The process dies here (nothing after this line of ckptvault runs)."""


def after_power_loss(world: Path, action, ledger: Path | None = None) -> dict:
    """Run ``action`` recorded, then what the disk holds when power fails right after
    it returned, with everything not made durable lost: path -> (kind, mode, bytes, _)."""
    recorder = Recorder(world, ledger)
    with recorder.recording():
        action()
    recorder.check_complete()
    *_, last = crash_states(recorder.base, recorder.base_ledger, recorder.log, ("lost",))
    return describe_tree(last.tree)


def test_a_new_key_stores_first_key_survives_a_power_cut(tmp_path: Path):
    world = tmp_path / "world"
    world.mkdir()
    keys = LocalKeyStore(world / "secure" / "keys")
    kept = after_power_loss(world, lambda: keys.wrap("run", os.urandom(32), b"context"))
    [key_file] = [path for path in kept if path.endswith(".kek")]
    assert kept[key_file][2] == (world / key_file.lstrip("/")).read_bytes()
    assert kept["/secure/keys"][1] == 0o700


def test_a_new_audit_logs_first_entry_survives_a_power_cut(tmp_path: Path):
    world = tmp_path / "world"
    world.mkdir()
    log = AuditLog(world / "audit" / "audit.jsonl", Ledger(tmp_path / "ledger.sqlite3"))
    kept = after_power_loss(world, lambda: log.append("save", step=1), tmp_path / "ledger.sqlite3")
    assert kept["/audit/audit.jsonl"][2] == (world / "audit" / "audit.jsonl").read_bytes()


def test_a_stores_first_pin_survives_a_power_cut(tmp_path: Path):
    world = tmp_path / "world"
    (world / "store").mkdir(parents=True)
    store = PosixStore(world / "store")
    name = "step-000000000001.20260101T000000000000Z-00000000"
    kept = after_power_loss(world, lambda: store.put_record(PIN, name, {"step": 1}))
    assert f"/store/.records/{PIN}/{name}.json" in kept


@pytest.fixture
def audited(tmp_path: Path) -> tuple[AuditLog, Path, Ledger]:
    ledger = Ledger(tmp_path / "ledger.sqlite3")
    log = AuditLog(tmp_path / "audit.jsonl", ledger)
    log.append("save", step=1)
    return log, tmp_path / "audit.jsonl", ledger


def test_an_append_whose_head_was_never_recorded_is_adopted(audited, monkeypatch):
    log, path, ledger = audited
    crash_before_the_head(log, monkeypatch)  # written and fsync'd; the head never recorded
    assert verify_audit_log(path, ledger).ok
    log.append("save", step=3)
    report = verify_audit_log(path, ledger)
    assert report.ok and report.entries == 3 and not report.gaps
    assert ledger.audit_pending(str(path)) is None


def test_an_append_a_crash_tore_is_cut_off(audited, monkeypatch):
    log, path, ledger = audited
    before = path.read_bytes()
    real_write = os.write

    def torn(fd: int, data: bytes) -> int:
        real_write(fd, data[: len(data) // 2])
        raise Crash

    with monkeypatch.context() as patched:
        patched.setattr(os, "write", torn)
        with pytest.raises(Crash):
            log.append("save", step=2)
    assert path.read_bytes() != before  # half an entry is in the log
    assert verify_audit_log(path, ledger).ok  # ... and the ledger says whose it is
    log.append("save", step=3)
    report = verify_audit_log(path, ledger)
    assert report.ok and report.entries == 2 and not report.gaps
    assert path.read_bytes().startswith(before)


def crash_before_the_head(log: AuditLog, monkeypatch: pytest.MonkeyPatch) -> None:
    def die(*args: object) -> None:
        raise Crash

    with monkeypatch.context() as patched:
        patched.setattr(Ledger, "set_audit_head", die)
        with pytest.raises(Crash):
            log.append("save", step=2)


def test_a_pending_append_vouches_for_its_own_bytes_only(audited, monkeypatch):
    """An entry added after the one a crash left pending still makes a gap."""
    log, path, ledger = audited
    crash_before_the_head(log, monkeypatch)
    other = path.with_name("other.jsonl")
    other.write_bytes(path.read_bytes())
    AuditLog(other, None).append("restore", step=2)  # a well-chained entry, not ckptvault's
    path.write_bytes(other.read_bytes())
    assert not verify_audit_log(path, ledger).ok
    log.append("save", step=3)
    report = verify_audit_log(path, ledger)
    assert not report.ok and report.gaps[0]["kind"] == "unrecorded"


def test_a_pending_append_edited_after_the_crash_fails_verification(audited, monkeypatch):
    log, path, ledger = audited
    crash_before_the_head(log, monkeypatch)
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + lines[1].replace(b'"step":2', b'"step":9'))
    log.append("save", step=3)
    assert not verify_audit_log(path, ledger).ok
