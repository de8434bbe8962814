"""Help text reads well at any width, through a pipe too: each command's summary and
each paragraph of its help is one line of text that the terminal wraps, never the
source's line breaks (which, at 80 columns, broke sentences in the middle)."""

from __future__ import annotations

import re
from typing import Any

import typer

from ckptvault.cli import app, reflowed
from support.common import run_cli


def _commands(group: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Every command under ``group`` (typer ships its own click: duck-typed)."""
    found = []
    for name, command in group.commands.items():
        found.append((prefix + name, command))
        if hasattr(command, "commands"):
            found += _commands(command, f"{prefix}{name} ")
    return found


def test_every_summary_and_help_paragraph_is_one_flowing_line():
    root = typer.main.get_command(app)
    commands = _commands(root)
    assert len(commands) >= 20
    for name, command in commands:
        summary = command.get_short_help_str(limit=10_000)
        assert "\n" not in summary, f"ckptvault {name}: {summary!r}"
        for paragraph in re.split(r"\n\s*\n", command.help or ""):
            listed = re.search(r"\n\s*([-*]|\d+[.)]|\s)", paragraph)
            assert listed or "\n" not in paragraph, f"ckptvault {name}: {paragraph!r}"


def test_reflow_keeps_lists_and_joins_prose():
    doc = """First line
        goes on here.

        Exit statuses:
          0  fine
          1  not fine
        """
    assert reflowed(doc) == "First line goes on here.\n\nExit statuses:\n  0  fine\n  1  not fine"


def test_the_command_list_through_a_pipe_keeps_sentences_whole():
    result = run_cli("--help", env={"COLUMNS": "80"})
    assert result.returncode == 0
    assert "(exit 2 when" in result.stdout and "it does not: the reason" in result.stdout
    lines = [line.strip("│ ").rstrip() for line in result.stdout.splitlines()]
    assert not any(line.endswith("(exit 2 when") for line in lines), result.stdout
