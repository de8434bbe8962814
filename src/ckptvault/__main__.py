"""``python -m ckptvault`` runs the command-line tool."""

import sys

try:
    from ckptvault._entry import run

    run()
except KeyboardInterrupt:  # after the import, before run() took over: the same one line
    sys.stderr.write("interrupted\n")
    sys.exit(130)
