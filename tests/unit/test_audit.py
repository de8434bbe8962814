"""The audit log: saves, restores, refusals, rollbacks, exports, key destruction are
recorded in a hash chain; `ckptvault audit verify` catches edits, removals,
reordering and a cut-off tail."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

import ckptvault as cv
from ckptvault.errors import NoValidCheckpoint
from ckptvault.trust.audit import AuditLog
from ckptvault.trust.audit_verify import verify_audit_log
from ckptvault.trust.ledger import Ledger
from support.common import make_training_state, only_tensor_file, run_cli, writable


@pytest.fixture
def logged(store: Path, tmp_path: Path):
    """A run with saves, a restore and a refusal in its audit log."""
    ledger, log = tmp_path / "ledger.sqlite3", tmp_path / "audit.jsonl"
    options = {"run_id": "r", "ledger": ledger, "audit_log": log}
    with cv.CheckpointManager(store, **options) as mgr:
        first = mgr.save(1, make_training_state()).result()
        mgr.save(2, make_training_state())
        mgr.restore(make_training_state())
    shard = only_tensor_file(Path(first.path))
    writable(shard).write_bytes(b"x" * shard.stat().st_size)
    with cv.CheckpointManager(store, **options) as mgr, pytest.raises(NoValidCheckpoint):
        mgr.restore(make_training_state(), step=1)
    return log, ledger


def lines(log: Path) -> list[bytes]:
    return log.read_bytes().splitlines(keepends=True)


def audit_verify(log: Path, ledger: Path) -> tuple[int, dict]:
    result = run_cli("audit", "verify", str(log), "--ledger", str(ledger), "--json")
    return result.returncode, json.loads(result.stdout)


def test_events_are_recorded_and_chained(logged):
    log, ledger = logged
    entries = [json.loads(line) for line in lines(log)]
    assert [e["event"] for e in entries] == ["save", "save", "restore", "refusal"]
    assert [e["seq"] for e in entries] == [0, 1, 2, 3]
    assert entries[0]["prev"] == "0" * 64
    assert all(b["prev"] == a["hash"] for a, b in itertools.pairwise(entries))
    assert entries[2]["step"] == 2 and entries[3]["error"] == "RollbackError"
    assert entries[3]["rejected"][0][1] == 1 and "rollback" in entries[3]["rejected"][0][2]
    code, report = audit_verify(log, ledger)
    assert code == 0 and report["ok"] and report["entries"] == 4 and report["head_checked"]


def test_edited_entry(logged):
    log, ledger = logged
    content = lines(log)
    content[1] = content[1].replace(b'"step":2', b'"step":9')
    log.write_bytes(b"".join(content))
    code, report = audit_verify(log, ledger)
    assert code == 1 and any("edited" in p for p in report["problems"])


def test_removed_entry(logged):
    log, ledger = logged
    content = lines(log)
    del content[1]
    log.write_bytes(b"".join(content))
    code, report = audit_verify(log, ledger)
    assert code == 1 and any("removed or reordered" in p for p in report["problems"])


def test_reordered_entries(logged):
    log, ledger = logged
    content = lines(log)
    content[1], content[2] = content[2], content[1]
    log.write_bytes(b"".join(content))
    assert audit_verify(log, ledger)[0] == 1


def test_truncated_tail_is_caught_by_the_ledger_head(logged):
    log, ledger = logged
    log.write_bytes(b"".join(lines(log)[:-1]))  # a clean cut: the chain itself is intact
    report = verify_audit_log(log, None)
    assert report.ok  # without the head, a clean cut is invisible...
    code, report = audit_verify(log, ledger)
    assert code == 1 and any("cut off" in p for p in report["problems"])  # ...with it, caught


def test_entry_cut_mid_line(logged):
    log, ledger = logged
    data = log.read_bytes()
    log.write_bytes(data[:-20])
    assert audit_verify(log, ledger)[0] == 1


def test_appends_from_several_writers_stay_chained(tmp_path: Path):
    import threading

    ledger = Ledger(tmp_path / "l.sqlite3")
    log = AuditLog(tmp_path / "a.jsonl", ledger)

    def write(n: int) -> None:
        for i in range(20):
            log.append("save", run_id=f"w{n}", step=i)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report = verify_audit_log(tmp_path / "a.jsonl", ledger)
    assert report.ok and report.entries == 80, report.problems


def test_appended_forged_entries_are_caught(logged):
    from ckptvault.format.canonical import dumps_canonical
    from ckptvault.trust.audit import entry_hash

    log, ledger = logged
    last = json.loads(lines(log)[-1])
    forged = {
        "seq": last["seq"] + 1,
        "time": last["time"],
        "event": "restore",
        "run_id": "r",
        "prev": last["hash"],
    }
    forged["hash"] = entry_hash(forged)
    with open(log, "ab") as handle:
        handle.write(dumps_canonical(forged) + b"\n")
    assert verify_audit_log(log, None).ok  # the chain alone cannot tell...
    code, report = audit_verify(log, ledger)
    assert code == 1 and any("appended without the ledger" in p for p in report["problems"])


def test_a_log_whose_head_is_unknown_fails_unless_allowed(logged, tmp_path):
    log, _ = logged
    other_ledger = tmp_path / "other.sqlite3"
    Ledger(other_ledger).floor("x")  # exists, but holds no head for this log
    result = run_cli("audit", "verify", str(log), "--ledger", str(other_ledger))
    assert result.returncode == 1 and "holds no head" in result.stdout
    allowed = run_cli(
        "audit", "verify", str(log), "--ledger", str(other_ledger), "--allow-missing-head"
    )
    assert allowed.returncode == 0


def test_a_damaged_tail_is_kept_and_recorded_as_a_gap(store, tmp_path):
    """A log cut mid-entry no longer stops the run: the next save records a gap, the
    damaged bytes stay in place as evidence, and the log never verifies again."""
    log, ledger = tmp_path / "audit.jsonl", tmp_path / "l.sqlite3"
    options = {"run_id": "r", "ledger": ledger, "audit_log": log}
    with cv.CheckpointManager(store, **options) as mgr:
        mgr.save(1, make_training_state())
    damaged = log.read_bytes()[:-5]  # cut mid-entry
    log.write_bytes(damaged)
    with cv.CheckpointManager(store, **options) as mgr:
        mgr.save(2, make_training_state())
        assert [g.step for g in mgr.generations()] == [2, 1]
    assert log.read_bytes().startswith(damaged + b"\n")  # the evidence is untouched
    gap, save = (json.loads(line) for line in lines(log)[-2:])
    assert gap["event"] == "gap" and gap["damaged_bytes"] == len(damaged) + 1
    assert (gap["expected_entries"], gap["found_entries"]) == (1, 0)
    assert save["event"] == "save" and save["step"] == 2 and save["prev"] == gap["hash"]
    code, report = audit_verify(log, ledger)
    assert code == 1 and [g["kind"] for g in report["gaps"]] == ["truncated"]
    assert any("the entry with seq 0 was lost" in p for p in report["problems"])


def test_audit_log_inside_the_store_is_refused(store, tmp_path):
    with pytest.raises(cv.errors.UsageError, match="audit log"):
        cv.CheckpointManager(store, run_id="r", audit_log=store / "audit.jsonl")
