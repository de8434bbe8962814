"""Every Python block of the README and the site runs, or says visibly why not.

A page's runnable blocks (```python) run in order in ONE fresh process, in a temporary
working directory, sharing one namespace as a notebook would: a later block may use
what an earlier one defined. One test per page; a failure names the page, the block's
number and line, and the error. Blocks marked ```python title="fragment" must really
be fragments (use a name nothing on the page defines before them); blocks marked
```python { data-tested-by="tests/..." } are run by that test, which must exist and
name them. The markers are described in docs/contributing.md and
tests/support/doc_blocks.py.

Pages whose runnable blocks use an ``s3://`` or ``az://`` store run against the suite's
own servers (moto; Azurite), whose environment they get, with the buckets and
containers their URLs name created first. Each page's process is forked from the
worker's fork server (torch and ckptvault imported once), so a page costs its own
work, not another 2-3 s of imports.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from support.doc_blocks import REPO, RUN, blocks_of, checked, pages, run_page, servers_for

ALL_BLOCKS = {str(page.relative_to(REPO)): blocks_of(page) for page in pages()}
RUNNABLE = {page: [b for b in found if b.kind == RUN] for page, found in ALL_BLOCKS.items()}


def test_every_block_runs_or_is_marked():
    """Each python block's fence is a known marker; fragments are fragments; every
    data-tested-by names an existing test that reads the block; what any block calls
    on ckptvault exists."""
    problems = [p for found in ALL_BLOCKS.values() for p in checked(found)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("page", [page for page, runnable in RUNNABLE.items() if runnable])
def test_the_blocks_of_the_page_run(page: str, tmp_path: Path, request: pytest.FixtureRequest):
    blocks = RUNNABLE[page]
    env = dict(os.environ, **servers_for(blocks, request))
    node = f"docs-{os.getpid()}-{abs(hash(page)) % 10**8}"  # a memory tier's own directory
    env["CKPTVAULT_NODE"] = node
    try:
        failure = run_page(page, blocks, tmp_path, env)
    finally:
        for directory in Path("/dev/shm").glob(f"ckptvault-{os.getuid()}/*/{node}"):
            shutil.rmtree(directory, ignore_errors=True)
    assert failure is None, failure
