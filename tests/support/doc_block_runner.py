"""Run one page's Python blocks in order, in one namespace, like a notebook.

``python doc_block_runner.py SPEC.json``: SPEC holds the page's path, the working
directory and the blocks (number, fence line, code). Each block is compiled under
the page's own path with its lines where they are in the page, so a traceback names
the page and the line. The first block that raises (or exits non-zero) stops the
run: its number goes to the result file named in SPEC, the traceback to stderr, and
the process exits 1. Started by tests/docs/test_doc_blocks.py through the fork server.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    workdir = spec["cwd"]
    os.chdir(workdir)
    sys.path[0] = workdir  # as `python -c` would: the working directory first
    namespace: dict[str, object] = {"__name__": "__main__"}
    for block in spec["blocks"]:
        print(f"--- {spec['page']}: block {block['number']} (line {block['line']})", flush=True)
        source = "\n" * block["line"] + block["code"]  # line numbers as in the page
        try:
            exec(compile(source, spec["path"], "exec"), namespace)
        except SystemExit as exit_:
            if exit_.code in (None, 0):
                continue
            return _failed(spec, block, f"SystemExit({exit_.code!r})")
        except BaseException as error:  # reported with the block that raised it
            traceback.print_exc()
            return _failed(spec, block, f"{type(error).__name__}: {error}")
        sys.stdout.flush()
    return 0


def _failed(spec: dict, block: dict, error: str) -> int:
    result = {"number": block["number"], "line": block["line"], "error": error[-2000:]}
    Path(spec["result"]).write_text(json.dumps(result))
    sys.stderr.flush()
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
