"""The ``ckptvault`` command's entry point, kept tiny: a Ctrl-C that arrives while the
command-line tool is still being imported (typer, rich, the commands) ends it like one
that arrives later — one line, ``interrupted``, on stderr and exit status 130 —
instead of a traceback from the middle of an import."""

from __future__ import annotations

import sys

INTERRUPTED = 130  # 128 + SIGINT, as shells report it


class Interrupted(BaseException):
    """Ctrl-C inside a command, carried past click (which would turn a
    ``KeyboardInterrupt`` into an ``Abort`` after printing a blank line) to the
    command line's main, which prints ``interrupted`` and exits 130. A
    ``BaseException``: no ``except Exception`` on the way swallows it, every
    ``finally`` on the way runs (temporary files are removed)."""


def interrupted() -> int:
    """Say so on stderr, in one line; the exit status."""
    try:
        sys.stderr.write("interrupted\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed or gone: the status says it
        pass
    return INTERRUPTED


def run() -> None:
    """Import and run the command line; exit with its status."""
    try:
        from ckptvault.cli import main

        code = main()
    except (KeyboardInterrupt, Interrupted):
        code = interrupted()
    sys.exit(code)
