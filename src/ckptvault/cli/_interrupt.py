"""Ctrl-C in the command line: one line, ``interrupted``, on stderr and exit status 130.

A ``KeyboardInterrupt`` inside a command would reach click, which prints a blank line
and raises ``Abort``; each command's callback raises :class:`Interrupted` instead,
which click lets pass, and the command line's ``main`` says it in one line. Ctrl-C
while the command line is still being imported is caught by ``ckptvault.__main__``
(the console script's entry too), the same way.
"""

from __future__ import annotations

import sys

INTERRUPTED = 130  # 128 + SIGINT, as shells report it


class Interrupted(BaseException):
    """Ctrl-C inside a command, carried past click to the command line's main. A
    ``BaseException``: no ``except Exception`` on the way swallows it, and every
    ``finally`` on the way runs (temporary output files are removed)."""


def interrupted() -> int:
    """Say so on stderr, in one line; the exit status."""
    try:
        sys.stderr.write("interrupted\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed or gone: the status says it
        pass
    return INTERRUPTED
