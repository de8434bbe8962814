"""What ckptvault records and reports about trust must not be launderable: a cut audit
log stays visibly cut after the next append, a signer is named only once verified,
and a signed export is only made from a source whose signature was verified.

Each test performs the attack on real files (and through the real command line)
and asserts the secure outcome."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

import ckptvault as cv
from ckptvault.errors import NoValidCheckpoint, UsageError
from ckptvault.format.canonical import dumps_canonical
from ckptvault.ops.export import export_weights
from ckptvault.ops.export_manifest import export_manifest_paths, verify_export
from ckptvault.trust.audit import AuditLog, entry_hash
from ckptvault.trust.audit_verify import verify_audit_log
from ckptvault.trust.ledger import Ledger
from ckptvault.trust.signing import MANIFEST_DOMAIN, generate_keypair, load_private_key, sign
from support.common import make_training_state, run_cli, writable

# -- 1. a cut audit log is not laundered by the next append ---------------------------


def entries(log: Path) -> list[dict]:
    return [json.loads(line) for line in log.read_bytes().splitlines()]


def audit_verify(log: Path, ledger: Path) -> tuple[int, dict]:
    result = run_cli("audit", "verify", str(log), "--ledger", str(ledger), "--json")
    return result.returncode, json.loads(result.stdout)


@pytest.fixture
def five(tmp_path: Path) -> tuple[Path, Path, AuditLog]:
    """An audit log of five entries, its head in the ledger."""
    log, ledger = tmp_path / "audit.jsonl", tmp_path / "ledger.sqlite3"
    audit = AuditLog(log, Ledger(ledger))
    for step in range(5):
        audit.append("save", run_id="r", step=step)
    return log, ledger, audit


def test_an_untampered_log_still_verifies(five):
    log, ledger, audit = five
    audit.append("restore", run_id="r", step=4)
    assert [e["event"] for e in entries(log)] == ["save"] * 5 + ["restore"]
    assert verify_audit_log(log, Ledger(ledger)).ok
    code, report = audit_verify(log, ledger)
    assert code == 0 and report["ok"] and report["entries"] == 6 and report["gaps"] == []


def test_a_cut_tail_is_recorded_as_a_gap_by_the_next_append(five, caplog):
    log, ledger, audit = five
    original = entries(log)
    log.write_bytes(b"".join(log.read_bytes().splitlines(keepends=True)[:3]))  # a clean cut
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        appended = audit.append("save", run_id="r", step=5)
    after = entries(log)
    assert after[:3] == original[:3]
    gap = after[3]
    assert gap["event"] == "gap" and gap["kind"] == "truncated"
    assert (gap["expected_entries"], gap["expected_hash"]) == (5, original[4]["hash"])
    assert (gap["found_entries"], gap["found_hash"]) == (3, original[2]["hash"])
    assert gap["seq"] == 3 and gap["prev"] == original[2]["hash"]  # a linked segment
    assert after[4] == appended and appended["prev"] == gap["hash"] and appended["step"] == 5
    assert any(
        r.levelno == logging.WARNING and "seq 3-4 were lost" in r.getMessage()
        for r in caplog.records
    )
    # The ledger's head follows the log, but the log never verifies again.
    assert Ledger(ledger).audit_head(str(log.resolve())) == (5, appended["hash"])
    report = verify_audit_log(log, Ledger(ledger))
    assert not report.ok and [g["line"] for g in report.gaps] == [4]
    assert any("the entries with seq 3-4 were lost" in p for p in report.problems)
    code, cli = audit_verify(log, ledger)
    assert code == 1 and not cli["ok"]
    assert any("records a gap" in p and "seq 3-4" in p for p in cli["problems"])
    # Nor after any number of further appends.
    for step in range(6, 9):
        audit.append("save", run_id="r", step=step)
    assert audit_verify(log, ledger)[0] == 1
    human = run_cli("audit", "verify", str(log), "--ledger", str(ledger))
    assert human.returncode == 1 and "records a gap" in human.stdout


def test_a_deleted_log_is_recorded_as_a_gap(five):
    log, ledger, audit = five
    log.unlink()
    audit.append("save", run_id="r", step=5)
    gap = entries(log)[0]
    assert gap["event"] == "gap" and gap["prev"] == "0" * 64
    assert (gap["expected_entries"], gap["found_entries"]) == (5, 0)
    assert audit_verify(log, ledger)[0] == 1


def test_a_replaced_log_of_the_same_length_is_recorded_as_a_gap(five, tmp_path):
    log, ledger, audit = five
    forged = tmp_path / "forged.jsonl"
    other = AuditLog(forged, None)
    for step in range(5):
        other.append("save", run_id="r", step=100 + step)
    log.write_bytes(forged.read_bytes())  # a valid chain, but not the one the ledger saw
    audit.append("save", run_id="r", step=5)
    gap = entries(log)[5]
    assert gap["event"] == "gap" and gap["kind"] == "rewritten"
    assert (gap["expected_entries"], gap["found_entries"]) == (5, 5)
    code, report = audit_verify(log, ledger)
    assert code == 1 and any("rewritten or replaced" in p for p in report["problems"])


def test_entries_appended_behind_the_ledger_are_not_adopted(five):
    log, ledger, audit = five
    last = entries(log)[-1]
    forged = {"seq": 5, "time": last["time"], "event": "restore", "run_id": "r"}
    forged["prev"] = last["hash"]
    forged["hash"] = entry_hash(forged)
    with open(log, "ab") as handle:
        handle.write(dumps_canonical(forged) + b"\n")
    audit.append("save", run_id="r", step=5)
    gap = entries(log)[6]
    assert gap["event"] == "gap" and gap["kind"] == "unrecorded"
    assert (gap["expected_entries"], gap["found_entries"]) == (5, 6)
    code, report = audit_verify(log, ledger)
    assert code == 1 and any("appended without the ledger" in p for p in report["problems"])


def test_a_log_the_ledger_never_saw_is_recorded_as_a_gap(five, tmp_path):
    _, ledger, _ = five
    # Another log, written with another ledger, offered to a ledger that keeps heads
    # of other logs but none of this one.
    elsewhere = tmp_path / "elsewhere.jsonl"
    stranger = AuditLog(elsewhere, Ledger(tmp_path / "other.sqlite3"))
    stranger.append("save", run_id="r", step=1)
    AuditLog(elsewhere, Ledger(ledger)).append("save", run_id="r", step=2)
    gap = entries(elsewhere)[1]
    assert gap["event"] == "gap" and gap["kind"] == "no-head"
    assert gap["expected_entries"] is None and gap["found_entries"] == 1
    assert audit_verify(elsewhere, ledger)[0] == 1


def test_a_fresh_ledger_adopts_a_log_with_a_warning(five, tmp_path, caplog):
    """What cannot be detected: a ledger holding no audit head at all cannot tell a
    log it never saw from one that lost entries. It adopts the log, and says so."""
    log, _, _ = five
    fresh = tmp_path / "fresh.sqlite3"
    with caplog.at_level(logging.WARNING, logger="ckptvault"):
        AuditLog(log, Ledger(fresh)).append("save", run_id="r", step=5)
    assert [e["event"] for e in entries(log)] == ["save"] * 6
    assert any("adopted as it stands" in r.getMessage() for r in caplog.records)
    assert audit_verify(log, fresh)[0] == 0


def test_a_log_cut_mid_entry_keeps_the_damaged_bytes_as_evidence(five):
    log, ledger, audit = five
    data = log.read_bytes()
    cut = data[:-30]  # the last entry loses its end and its newline
    log.write_bytes(cut)
    audit.append("save", run_id="r", step=5)
    content = log.read_bytes()
    assert content.startswith(cut + b"\n")  # the damaged bytes stay where they were
    remnant = cut[cut.rfind(b"\n") + 1 :]
    gap = json.loads(content.splitlines()[5])
    assert gap["event"] == "gap" and gap["kind"] == "truncated"
    assert (gap["expected_entries"], gap["found_entries"]) == (5, 4)
    assert gap["damaged_bytes"] == len(remnant) + 1
    code, report = audit_verify(log, ledger)
    assert code == 1 and report["entries"] == 6  # four intact, the gap, the new entry
    (problem,) = report["problems"]  # the gap, and nothing the gap accounts for
    assert "the entry with seq 4 was lost" in problem and "kept" in problem
    # Changing the evidence afterwards is caught as well.
    log.write_bytes(content.replace(remnant, b"x" * len(remnant), 1))
    code, report = audit_verify(log, ledger)
    assert code == 1 and any("evidence was changed" in p for p in report["problems"])


def test_a_cut_log_through_the_manager_records_a_gap(store, tmp_path):
    log, ledger = tmp_path / "audit.jsonl", tmp_path / "ledger.sqlite3"
    options = {"run_id": "r", "ledger": ledger, "audit_log": log}
    with cv.CheckpointManager(store, **options) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, make_training_state())
        mgr.restore(make_training_state())  # the restore of step 3 is recorded...
    log.write_bytes(b"".join(log.read_bytes().splitlines(keepends=True)[:3]))  # ...and cut
    with cv.CheckpointManager(store, **options) as mgr:
        mgr.save(4, make_training_state())
    assert [e["event"] for e in entries(log)] == ["save", "save", "save", "gap", "save"]
    code, report = audit_verify(log, ledger)
    assert code == 1 and any("the entry with seq 3 was lost" in p for p in report["problems"])


# -- 2. a signer is reported only once verified ---------------------------------------


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, object]:
    found: dict[str, object] = {}
    for name in ("a", "b"):
        found[f"{name}_id"] = generate_keypair(tmp_path / f"{name}.pem", tmp_path / f"{name}.pub")
        found[name] = tmp_path / f"{name}.pem"
        found[f"{name}_pub"] = tmp_path / f"{name}.pub"
    return found


@pytest.fixture
def signed_by_a(store: Path, keys) -> dict[int, Path]:
    """Steps 1 and 2 of run r, signed by key A."""
    with cv.CheckpointManager(store, run_id="r", signing_key=keys["a"]) as mgr:
        return {step: Path(mgr.save(step, make_training_state()).result().path) for step in (1, 2)}


def restored_signer(store: Path, **options) -> tuple[int, str | None]:
    with cv.CheckpointManager(store, run_id="r", **options) as mgr:
        info = mgr.restore(make_training_state(seed=3))
    return info.step, info.signer


def verified_signers(store: Path, *args: str) -> dict[int, dict]:
    result = run_cli("verify", str(store), "--all", "--json", *args)
    return {report["step"]: report for report in json.loads(result.stdout)}


def test_a_signer_is_unverified_without_trusted_keys(store, keys, signed_by_a):
    assert restored_signer(store) == (2, "unverified")
    reports = verified_signers(store)
    assert {step: r["signer"] for step, r in reports.items()} == {2: "unverified", 1: "unverified"}
    assert all(r["ok"] for r in reports.values())


def test_a_verified_signer_is_named(store, keys, signed_by_a):
    assert restored_signer(store, trusted_keys=[keys["a_pub"]]) == (2, keys["a_id"])
    reports = verified_signers(store, "--trusted-key", str(keys["a_pub"]))
    assert {step: r["signer"] for step, r in reports.items()} == {2: keys["a_id"], 1: keys["a_id"]}


def test_an_unsigned_generation_has_no_signer(store):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(1, make_training_state())
    assert restored_signer(store) == (1, None)
    assert verified_signers(store)[1]["signer"] is None


def test_a_forged_claim_of_another_key_is_never_reported(store, keys, signed_by_a):
    # manifest.sig of step 2 now claims key B, over a signature B never made.
    generation = signed_by_a[2]
    document = json.loads(
        sign(
            load_private_key(keys["a"]),
            (generation / "manifest.json").read_bytes(),
            MANIFEST_DOMAIN,
        )
    )
    document["key_id"] = keys["b_id"]
    writable(generation / "manifest.sig").write_bytes(dumps_canonical(document))
    b_id = str(keys["b_id"])

    # Without trusted keys: still well-formed, so it reads, but the claim is not reported.
    assert restored_signer(store) == (2, "unverified")
    plain = run_cli("verify", str(store), "--all", "--json")
    assert plain.returncode == 0 and b_id not in plain.stdout
    assert verified_signers(store)[2]["signer"] == "unverified"

    # Trusting B: the signature does not match, so step 2 is refused, never credited to B.
    both = ["--trusted-key", str(keys["a_pub"]), "--trusted-key", str(keys["b_pub"])]
    step, signer = restored_signer(store, trusted_keys=[keys["a_pub"], keys["b_pub"]])
    assert (step, signer) == (1, keys["a_id"])
    checked = run_cli("verify", str(store), "--all", "--json", *both)
    assert checked.returncode == 1
    reports = {r["step"]: r for r in json.loads(checked.stdout)}
    assert not reports[2]["ok"] and reports[2]["signer"] is None
    assert [p["code"] for p in reports[2]["problems"]] == ["signature-invalid"]
    assert reports[1]["signer"] == keys["a_id"]

    # Trusting only A: step 2 is refused as signed by an untrusted key.
    only_a = verified_signers(store, "--trusted-key", str(keys["a_pub"]))
    assert only_a[2]["signer"] is None
    assert [p["code"] for p in only_a[2]["problems"]] == ["signature-untrusted"]


# -- 3. a signed export vouches only for a verified source ----------------------------


@pytest.fixture
def planted(store: Path, keys) -> dict[str, str]:
    """Steps 1 and 2 signed by the trainer's key A; then, planted by whoever can write
    the store, an unsigned newer save of step 2 and an unsigned step 3."""
    model = torch.nn.Linear(4, 4)
    ids = {}
    with cv.CheckpointManager(store, run_id="r", signing_key=keys["a"]) as mgr:
        for step in (1, 2):
            ids[f"real{step}"] = mgr.save(step, {"model": model}).result().generation_id
    with torch.no_grad():
        model.weight.fill_(666.0)  # what the attacker wants shipped
    with cv.CheckpointManager(store, run_id="r") as mgr:  # no signing key
        for step in (2, 3):
            ids[f"planted{step}"] = mgr.save(step, {"model": model}).result().generation_id
    return ids


def export_cli(store: Path, step: int, out: Path, *extra: str):
    return run_cli("export", str(store), "--step", str(step), "--out", str(out), *extra)


def test_signing_an_export_without_trusted_keys_is_refused(store, tmp_path, keys, planted):
    out = tmp_path / "release" / "model.safetensors"
    result = export_cli(store, 3, out, "--signing-key", str(keys["a"]))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "signing an export vouches for its source" in result.stderr
    assert "--trusted-key" in result.stderr
    assert not out.exists() and not any(p.exists() for p in export_manifest_paths(out))
    with pytest.raises(UsageError, match="signing an export vouches for its source"):
        export_weights(store, 3, out, signing_key=keys["a"])
    assert not out.exists()


def test_a_planted_unsigned_generation_is_never_signed_for_release(store, tmp_path, keys, planted):
    sign_and_trust = ["--signing-key", str(keys["a"]), "--trusted-key", str(keys["a_pub"])]
    out = tmp_path / "model.safetensors"
    refused = export_cli(store, 3, out, *sign_and_trust)
    assert refused.returncode == 2 and "signature-missing" in refused.stderr
    assert not out.exists() and not any(p.exists() for p in export_manifest_paths(out))
    with pytest.raises(NoValidCheckpoint, match="signature-missing"):
        export_weights(store, 3, out, signing_key=keys["a"], trusted_keys=[keys["a_pub"]])
    # Step 2: the planted newer save is skipped; the signed one is what gets released.
    exported = export_cli(store, 2, out, *sign_and_trust)
    assert exported.returncode == 0, exported.stderr
    check = verify_export(out, [keys["a_pub"]])
    assert check.source["generation_id"] == planted["real2"] != planted["planted2"]
    from safetensors.torch import load_file

    assert not torch.any(load_file(out)["weight"] == 666.0)
