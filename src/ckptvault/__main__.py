"""``python -m ckptvault`` runs the command-line tool."""

from ckptvault.cli import run

run()
