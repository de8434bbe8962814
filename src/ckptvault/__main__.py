"""``python -m ckptvault`` and the ``ckptvault`` console script: the command line.

Importing the command line (typer, rich, every command) takes a moment; a Ctrl-C
then ends it as one later would: one line, ``interrupted``, on stderr and exit
status 130, not a traceback from the middle of an import.
"""

import sys


def run() -> None:
    """Import and run the command line; exit with its status."""
    try:
        from ckptvault.cli import main

        code = main()
    except KeyboardInterrupt:  # during the imports; main() says it itself later
        sys.stderr.write("interrupted\n")
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    try:
        run()
    except KeyboardInterrupt:  # between this module's start and run()'s own handler
        sys.stderr.write("interrupted\n")
        sys.exit(130)
