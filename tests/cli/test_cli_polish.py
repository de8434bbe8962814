"""The command line as a whole: every command has --help, every data command's --json
parses, a bad store or argument is one line on stderr and exit 2, and the command-line
guide (docs/guides/command-line.md, once the README's Command line section) names
every command (so the docs cannot fall behind)."""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import torch
import typer.main

import ckptvault as cv
from ckptvault.cli import app, main
from ckptvault.trust.signing import generate_keypair
from support.doc_pages import section as doc_section


def _commands() -> list[list[str]]:
    """Every command registered in ``ckptvault.cli.app``, groups expanded."""
    root = typer.main.get_command(app)
    names: list[list[str]] = []
    for name, command in root.commands.items():  # type: ignore[attr-defined]
        sub = getattr(command, "commands", None)
        names += [[name, s] for s in sub] if sub else [[name]]
    return names


COMMANDS = _commands()


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """Two small signed generations, with a catalog and an audit log beside them."""
    path = tmp_path / "store"
    generate_keypair(tmp_path / "k", tmp_path / "k.pub")
    options = dict(
        catalog=tmp_path / "catalog.sqlite3",
        audit_log=tmp_path / "audit.jsonl",
        signing_key=tmp_path / "k",
    )
    with cv.CheckpointManager(path, run_id="r", **options) as mgr:
        for step in (1, 2):
            torch.manual_seed(step)
            mgr.save(step, {"model": torch.nn.Linear(4, 2)})
    return path


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_commands_are_all_found():
    names = {" ".join(c) for c in COMMANDS}
    assert {"ls", "verify", "gc", "plan", "drill", "supervise", "keys rotate"} <= names


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_every_command_has_help(capsys, command: list[str]):
    code, out, err = run(capsys, *command, "--help")
    assert code == 0 and err == ""
    assert "Usage:" in out and "--help" in out
    assert len(out.splitlines()) > 5  # a description and its options, not just a usage line


def _json_cases(store: Path, tmp: Path) -> dict[str, list[object]]:
    factory = tmp / "factory.py"
    factory.write_text(
        textwrap.dedent(
            """
            import torch

            def build():
                return {"model": torch.nn.Linear(4, 2)}
            """
        )
    )
    catalog = tmp / "catalog.sqlite3"
    (tmp / "keys").mkdir(exist_ok=True)  # an empty key store: a missing one exits 2
    return {
        "ls": ["ls", store],
        "inspect": ["inspect", store],
        "verify": ["verify", store, "--all"],
        "export": ["export", store, "--step", 2, "--out", tmp / "w.safetensors", "--key", "model"],
        "consolidate": ["consolidate", store, tmp / "hf"],
        "gc": ["gc", store, "--dry-run", "--keep-last", 1, "--trusted-key", tmp / "k.pub"],
        "plan": ["plan", "--save-seconds", 10, "--mtbf-hours", 4],
        "plan --from": ["plan", "--from", store, "--catalog", catalog, "--mtbf-hours", 4],
        "catalog": ["catalog", "--catalog", catalog],
        "status": ["status", store, "--catalog", catalog],
        "doctor": ["doctor", store, "--audit-log", tmp / "audit.jsonl"],
        "validate": ["validate", store, "--run-id", "r", "--factory", f"{factory}:build",
                     "--catalog", catalog],
        "drill": ["drill", store, "--only", "truncated-file,flipped-byte"],
        "audit verify": ["audit", "verify", tmp / "audit.jsonl"],
        "keys generate": ["keys", "generate", "--private", tmp / "k2", "--public", tmp / "k2.pub"],
        "keys list": ["keys", "list", "--keystore", tmp / "keys"],
    }  # fmt: skip


def test_every_data_command_prints_json(capsys, store: Path, tmp_path: Path):
    for name, args in _json_cases(store, tmp_path).items():
        code, out, err = run(capsys, *args, "--json")
        # status and doctor exit 1 for a warning or failed check: still a report.
        assert code in (0, 1) if name in ("status", "doctor") else code == 0, (name, err)
        assert json.loads(out) is not None, name
    # The export it wrote can be checked, in JSON too.
    signed = tmp_path / "signed.safetensors"
    assert run(capsys, "export", store, "--step", "1", "--out", signed, "--signing-key",
               tmp_path / "k", "--trusted-key", tmp_path / "k.pub")[0] == 0  # fmt: skip
    code, out, _ = run(
        capsys, "verify-export", signed, "--trusted-key", tmp_path / "k.pub", "--json"
    )
    assert code == 0 and json.loads(out)["ok"] is True


def test_json_keeps_stderr_free_of_bars(capsys, store: Path, tmp_path: Path):
    """--json output is for programs: stdout is the JSON alone, stderr has no bar."""
    code, out, err = run(capsys, "export", store, "--step", 2, "--out", tmp_path / "w", "--json")
    assert code == 0 and err == ""
    report = json.loads(out)
    assert report["step"] == 2 and report["tensors"] == 2 and Path(report["path"]).is_file()


# Each command that takes a store, with the rest of what it needs; {store} is replaced.
STORE_COMMANDS = {
    "ls": ["ls", "{store}"],
    "inspect": ["inspect", "{store}"],
    "verify": ["verify", "{store}"],
    "export": ["export", "{store}", "--step", "1", "--out", "{tmp}/w.safetensors"],
    "consolidate": ["consolidate", "{store}", "{tmp}/hf"],
    "gc": ["gc", "{store}"],
    "plan": ["plan", "--from", "{store}", "--mtbf-hours", "4"],
    "status": ["status", "{store}"],
    "doctor": ["doctor", "{store}"],
    "validate": ["validate", "{store}", "--run-id", "r", "--factory", "json:loads"],
    "drill": ["drill", "{store}"],
    "keys rotate": ["keys", "rotate", "--keystore", "{tmp}/keys", "--run", "r", "--store", "{store}"],
    "catalog": ["catalog", "--catalog", "{store}/catalog.sqlite3"],
    "audit verify": ["audit", "verify", "{store}/audit.jsonl"],
}  # fmt: skip


@pytest.mark.parametrize("name", STORE_COMMANDS)
def test_a_bad_store_is_one_line_and_exit_2(capsys, tmp_path: Path, name: str):
    missing = tmp_path / "no-such-store"
    args = [a.format(store=missing, tmp=tmp_path) for a in STORE_COMMANDS[name]]
    code, out, err = run(capsys, *args)
    assert code == 2, (err, out)
    assert out == "" and len(err.splitlines()) == 1 and err.startswith("ckptvault: error: ")
    assert str(missing) in err
    assert not missing.exists()  # nothing was created on the way


@pytest.mark.parametrize(
    "args",
    [
        ["plan", "--save-seconds", "fast"],
        ["plan", "--save-seconds", "-1", "--mtbf-hours", "4"],
        ["plan"],
        ["catalog", "--limit", "0"],
        ["catalog", "--ledger", "a", "--catalog", "b"],
        ["status", "{store}", "--cadence-seconds", "-5"],
        ["status", "{store}", "--json", "--prometheus"],
        ["doctor", "{store}", "--no-such-option"],
        ["validate", "{store}", "--run-id", "r"],
        ["validate", "{store}", "--run-id", "r", "--factory", "no_such_module_xyz:f"],
        ["drill"],
        ["drill", "{store}", "--synthetic"],
        ["drill", "{store}", "--only", "no-such-drill"],
        ["supervise"],
        ["supervise", "--backoff", "a,b", "--", "true"],
        ["supervise", "--max-restarts", "-1", "--", "true"],
        ["supervise", "--min-free-bytes", "10G", "--", "true"],
    ],
    ids=lambda args: " ".join(args),
)
def test_a_bad_argument_is_one_line_and_exit_2(capsys, store: Path, args: list[str]):
    code, out, err = run(capsys, *[a.format(store=store) for a in args])
    assert code == 2, (out, err)
    assert len(err.splitlines()) == 1 and err.startswith("ckptvault: error: "), err


def _command_line_section() -> str:
    """The command-line guide, wherever the docs hold it (its Errors part too); the
    reference page "Command line" is generated from the app, so it cannot fall behind."""
    return doc_section("The command line").body


def test_readme_names_every_command():
    section = _command_line_section()
    for command in COMMANDS:
        synopsis = "ckptvault " + " ".join(command)
        assert re.search(rf"^{re.escape(synopsis)}( |$)", section, re.M), synopsis


def test_readme_has_an_exit_code_row_for_every_command():
    table = [line for line in _command_line_section().splitlines() if line.startswith("| `")]
    documented = {
        name for line in table for name in re.findall(r"`([a-z -]+)`", line.split("|")[1])
    }
    assert {" ".join(command) for command in COMMANDS} <= documented
