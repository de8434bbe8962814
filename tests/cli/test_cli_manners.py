"""Command-line habits a new user runs into (issue 28, item 4): ``--version``, help
that agrees with the defaults it shows, exit codes for things that are not there,
``status`` of a finished run, Ctrl-C, and errors in the command line's words."""

from __future__ import annotations

import re

from ckptvault._version import __version__
from ckptvault.cli import main
from ckptvault.ops.supervise import Policy
from support.common import run_cli


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"ckptvault {__version__}\n"


def test_supervise_help_says_the_default_restart_budget_it_shows():
    result = run_cli("supervise", "--help", env={"COLUMNS": "250"})
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert Policy().max_restarts == 2
    assert "[default: 2]" in text and "default 2 restarts: 3 attempts" in text
    assert not re.search(r"default 3\b(?! attempts)", text), text
