"""Hostile state, export and the CLI (see ``test_hostile_state``): export reads
through the same rules as restore, every string a store plants is printed inert
(no control character reaches the terminal, no markup is interpreted), an error the
CLI did not anticipate is one line, and a planted writer lock is only a message.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import ckptvault as cv
from ckptvault.cli import main
from ckptvault.errors import StoreLockedError
from ckptvault.format.canonical import dumps_canonical
from ckptvault.ops import export as export_module
from ckptvault.ops.export import export_weights
from ckptvault.storage.posix.store import PosixStore
from ckptvault.storage.records import DELETION_MARK
from ckptvault.trust import checks
from ckptvault.trust.context import TrustContext
from ckptvault.trust.keystore import LocalKeyStore
from ckptvault.trust.signing import generate_keypair
from support.common import (
    run_cli,
)
from support.hostile_forging import forge_manifest
from support.hostile_inputs import deep, save_two_steps
from support.hostile_state import (
    ESC,
    plant_copy,
    remove_generation,
)


@pytest.fixture
def two_steps(store: Path) -> tuple[dict[int, Path], dict[int, dict]]:
    """Steps 1 and 2 of an unsigned run (format 3); the attacks target step 2."""
    return save_two_steps(store)


# -- 9. export reads through the same rules as restore -------------------------------


def test_export_refuses_planted_plaintext_in_an_encrypted_run(tmp_path):
    store, keys = tmp_path / "store", tmp_path / "keys"
    model = torch.nn.Linear(4, 3)
    with cv.CheckpointManager(store, run_id="r", keystore=keys) as mgr:
        mgr.save(10, {"model": model})
    evil = torch.nn.Linear(4, 3)
    with torch.no_grad():
        evil.weight.fill_(1337.0)
    elsewhere = tmp_path / "elsewhere"
    with cv.CheckpointManager(elsewhere, run_id="r") as mgr:
        planted = Path(mgr.save(10, {"model": evil}).result().path)
    shutil.copytree(planted, store / planted.name)  # the newest generation of step 10
    out = tmp_path / "model.safetensors"
    export_weights(store, 10, out, keystore=LocalKeyStore(keys))
    assert torch.equal(load_file(out)["weight"], model.weight.detach())
    remove_generation(next(p for p in store.glob("step-*") if p.name != planted.name))
    result = run_cli(
        "export", str(store), "--step", "10", "--out", str(out), "--keystore", str(keys)
    )
    assert result.returncode == 2 and "not-encrypted" in result.stderr
    assert torch.equal(load_file(out)["weight"], model.weight.detach())


def test_export_learns_the_run_id_cheaply(store, tmp_path, monkeypatch):
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    with cv.CheckpointManager(store, run_id="r", signing_key=tmp_path / "k.pem") as mgr:
        for step in (1, 2):
            mgr.save(step, {"model": torch.nn.Linear(2, 2)})
    good = next(store.glob("step-000000000002.*"))
    for index in range(3):  # unsigned, newer, of the step asked for and of another
        plant_copy(good, 2, f"20991231T23595900000{index}Z-deadbeef")
        plant_copy(good, 3, f"20991231T23595900000{index}Z-deadbeef")
    parsed: list[int] = []
    original = checks.parse_manifest

    def counting(data: bytes, where: str) -> Any:
        parsed.append(len(data))
        return original(data, where)

    monkeypatch.setattr(checks, "parse_manifest", counting)
    trust = TrustContext.configure(trusted_keys=[tmp_path / "k.pub"])
    opened = PosixStore(store)
    assert export_module._only_run(opened, 2, trust) == "r"
    assert len(parsed) == 1  # the genuine one: the planted ones failed their signature
    parsed.clear()
    assert export_module._only_run(opened, 2, TrustContext()) == "r"
    assert len(parsed) <= export_module.MAX_RUN_PROBES
    out = tmp_path / "model.safetensors"
    result = run_cli(
        "export",
        str(store),
        "--step",
        "2",
        "--out",
        str(out),
        "--trusted-key",
        str(tmp_path / "k.pub"),
    )
    assert result.returncode == 0, result.stderr


def test_export_refuses_runs_that_disagree(store, tmp_path):
    with cv.CheckpointManager(store, run_id="r") as mgr:
        mgr.save(2, {"model": torch.nn.Linear(2, 2)})
    good = next(store.glob("step-000000000002.*"))
    planted = plant_copy(good, 2, "20991231T235959000000Z-deadbeef")
    forge_manifest(planted, lambda document: document.__setitem__("run_id", "evil"))
    with pytest.raises(cv.errors.UsageError, match="evil, r"):
        export_weights(store, 2, tmp_path / "x.safetensors")


# -- 10. what the CLI prints ----------------------------------------------------------

HOSTILE = "r[/bold][link=https://evil.example/]x[/link]\x1b]0;pwned\x07\x1b[2J\x9b31m\u202e"


def assert_terminal_safe(text: str) -> None:
    for char in (ESC, "\x07", "\x9b", "\u202e"):
        assert char not in text, repr(text[:300])


def test_inspect_prints_store_strings_inert(store, two_steps):
    paths, _ = two_steps
    forge_manifest(paths[2], lambda document: document.__setitem__("run_id", HOSTILE))
    human = run_cli("inspect", str(store), "--step", "2")
    assert human.returncode == 0, human.stderr
    assert_terminal_safe(human.stdout)
    assert "r[/bold][link=https://evil.example/]x[/link]\\x1b]0;pwned\\x07" in human.stdout
    as_json = run_cli("inspect", str(store), "--step", "2", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert_terminal_safe(as_json.stdout)
    assert json.loads(as_json.stdout)["generation"]["run_id"] == HOSTILE  # exact JSON


def test_inspect_markup_in_names_does_not_crash(store, two_steps, capsys):
    paths, _ = two_steps
    forge_manifest(paths[2], lambda document: document.__setitem__("run_id", "r[/bold]"))
    assert main(["inspect", str(store), "--step", "2"]) == 0
    assert "run r[/bold]" in capsys.readouterr().out


def test_verify_prints_planted_key_ids_inert(store, two_steps, tmp_path):
    paths, _ = two_steps
    generate_keypair(tmp_path / "k.pem", tmp_path / "k.pub")
    signature = {
        "algorithm": "ed25519",
        "format": "ckptvault-signature/1",
        "key_id": HOSTILE,
        "signature": "",
    }
    paths[2].chmod(0o755)
    (paths[2] / "manifest.sig").write_bytes(dumps_canonical(signature))
    human = run_cli("verify", str(store), "--step", "2", "--trusted-key", str(tmp_path / "k.pub"))
    assert human.returncode == 1 and "signature-untrusted" in human.stdout
    assert_terminal_safe(human.stdout + human.stderr)
    as_json = run_cli(
        "verify", str(store), "--step", "2", "--json", "--trusted-key", str(tmp_path / "k.pub")
    )
    assert as_json.returncode == 1
    assert_terminal_safe(as_json.stdout)
    (report,) = json.loads(as_json.stdout)
    assert any(HOSTILE in p["detail"] for p in report["problems"])  # exact, not lost
    # An error line (and the warnings before it) quote the same key id: inert too.
    failed = run_cli(
        "export",
        str(store),
        "--step",
        "2",
        "--out",
        str(tmp_path / "x"),
        "--trusted-key",
        str(tmp_path / "k.pub"),
        "--run-id",
        "r",
    )
    assert failed.returncode == 2 and "Traceback" not in failed.stderr
    assert_terminal_safe(failed.stderr)
    assert failed.stderr.strip().splitlines()[-1].startswith("ckptvault: error:")


def test_ls_prints_planted_marks_inert(store, two_steps):
    paths, _ = two_steps
    PosixStore(store).put_record(
        DELETION_MARK, paths[2].name, {"marked_at": "2020-01-01T00:00:00Z", "reason": HOSTILE}
    )
    listed = run_cli("ls", str(store), "--all")
    assert listed.returncode == 0, listed.stderr
    assert_terminal_safe(listed.stdout)
    as_json = run_cli("ls", str(store), "--all", "--json")
    assert_terminal_safe(as_json.stdout)
    marked = [entry for entry in json.loads(as_json.stdout) if entry.get("marked")]
    assert marked and marked[0]["marked"]["reason"] == HOSTILE


# -- errors the CLI prints, and a planted writer lock --------------------------------


def test_cli_turns_an_unexpected_error_into_one_line(store, two_steps, monkeypatch, capsys):
    def broken(_store, **_options):
        raise RuntimeError("something nobody anticipated\non two lines")

    # ckptvault.cli's ``ls`` attribute is the command, not its module.
    monkeypatch.setattr(
        importlib.import_module("ckptvault.cli.ls"), "list_generation_infos", broken
    )
    assert main(["ls", str(store)]) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert "internal error: RuntimeError" in lines[0] and "please report" in lines[0]


def test_cli_errors_stay_exit_2(tmp_path, capsys):
    assert main(["ls", str(tmp_path / "missing")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_planted_writer_lock_contents(store):
    """The lock file lives in the store: its contents are only for the message."""
    holder = PosixStore(store)
    holder.acquire_writer()
    try:
        (store / ".writer.lock").write_bytes(deep(2000).encode())
        with pytest.raises(StoreLockedError, match="holder unknown"):
            PosixStore(store).acquire_writer()
    finally:
        holder.release_writer()
