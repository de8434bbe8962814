"""The doc-block runner itself, on pages written here: what it runs, what it refuses
to take as a marker, and how a failure is reported (page, block number, line)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from support.doc_blocks import (
    FRAGMENT,
    RUN,
    TESTED_ELSEWHERE,
    blocks_of,
    checked,
    run_page,
    servers_for,
)

PAGE = """# A page

Text.

```python
import json
numbers = [1, 2, 3]
```

## Using it

```python title="fragment"
mgr.save(step, state)
```

- a list item:

  ```python
  total = sum(numbers)  # defined by block 1: one namespace
  print(json.dumps(total))
  ```

```python { data-tested-by="tests/docs/test_doc_block_runner.py" }
print("A page with four blocks")
```
"""


def _site(tmp_path: Path, page: str) -> Path:
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "tests" / "docs").mkdir(parents=True)
    (root / "tests" / "docs" / "test_doc_block_runner.py").write_text(Path(__file__).read_text())
    (root / "docs" / "page.md").write_text(page)
    return root


def test_blocks_are_found_with_their_markers_and_run_as_a_notebook(tmp_path: Path):
    root = _site(tmp_path, PAGE)
    blocks = blocks_of(root / "docs" / "page.md", root)
    assert [(b.number, b.line, b.kind) for b in blocks] == [
        (1, 5, RUN),
        (2, 12, FRAGMENT),
        (3, 18, RUN),
        (4, 23, TESTED_ELSEWHERE),
    ]
    assert blocks[2].code.startswith("total = sum(numbers)")  # dedented
    assert blocks[1].heading == "Using it"
    assert list(checked(blocks, root)) == []
    runnable = [b for b in blocks if b.kind == RUN]
    (tmp_path / "run").mkdir()
    assert run_page("docs/page.md", runnable, tmp_path / "run", dict(os.environ), root) is None
    assert "6" in (tmp_path / "run" / "output.log").read_text().splitlines()


def test_a_failing_block_is_reported_with_its_page_number_and_line(tmp_path: Path):
    page = PAGE.replace("print(json.dumps(total))", "print(undefined_name)")
    root = _site(tmp_path, page)
    runnable = [b for b in blocks_of(root / "docs" / "page.md", root) if b.kind == RUN]
    (tmp_path / "run").mkdir()
    failure = run_page("docs/page.md", runnable, tmp_path / "run", dict(os.environ), root)
    assert failure is not None
    assert "docs/page.md, block 3 (line 18, under 'Using it') failed" in failure
    assert "NameError" in failure and "undefined_name" in failure
    assert 'page.md", line 20' in failure  # the traceback points into the page


def test_markers_that_do_not_hold_are_refused(tmp_path: Path):
    heading = f"{6 * 7} unnamed"  # a heading this file holds neither whole nor by its start
    page = (
        f"# {heading}\n\n```python fragment\nx = 1\n```\n\n"  # renders as a paragraph on the site
        '```python title="fragment"\nimport os\nprint(os.sep)\n```\n\n'  # runs as it is
        '```python { data-tested-by="tests/nowhere.py" }\nx = 2\n```\n\n'
        '```python { data-tested-by="tests/docs/test_doc_block_runner.py" }\nzzz_unnamed = 3\n```\n'
        "\n## Using it\n\n```python\nx = 4\n```\n\n"  # the test's heading finds this block,
        '```python { data-tested-by="tests/docs/test_doc_block_runner.py" }\nx = 5\n```\n'
    )
    root = _site(tmp_path, page)
    problems = list(checked(blocks_of(root / "docs" / "page.md", root), root))
    assert len(problems) == 5, problems
    assert "no marker this runner knows" in problems[0]
    assert "defines every name it uses" in problems[1]
    assert "no file under tests/" in problems[2]
    assert f"names neither the heading {heading!r}" in problems[3]
    assert "block 6 (line 26, under 'Using it')" in problems[4]
    assert "finds the first python block after it, not this one" in problems[4]


def _server_page(tmp_path: Path, url: str) -> tuple[Path, list]:
    code = (
        "import torch\nimport ckptvault as cv\n"
        f'with cv.CheckpointManager("{url}", run_id="r") as mgr:\n'
        '    mgr.save(1, {"w": torch.zeros(2)})\n'
        "    print([g.step for g in mgr.generations()])\n"
    )
    root = _site(tmp_path, f"# A store on a server\n\n```python\n{code}```\n")
    return root, blocks_of(root / "docs" / "page.md", root)


def test_a_block_with_an_s3_store_runs_on_the_suites_server(
    tmp_path: Path, request: pytest.FixtureRequest
):
    root, blocks = _server_page(tmp_path, "s3://docs-runner-bucket/run")
    env = dict(os.environ, **servers_for(blocks, request))  # the bucket is made first
    assert env["AWS_ENDPOINT_URL"] == request.getfixturevalue("s3_endpoint")
    (tmp_path / "run").mkdir()
    assert run_page("docs/page.md", blocks, tmp_path / "run", env, root) is None
    assert "[1]" in (tmp_path / "run" / "output.log").read_text().splitlines()


def test_a_block_with_an_azure_store_runs_on_the_suites_server(
    tmp_path: Path, request: pytest.FixtureRequest
):
    root, blocks = _server_page(tmp_path, "az://docs-runner/run")
    env = dict(os.environ, **servers_for(blocks, request))  # the container is made first
    assert "AZURE_STORAGE_CONNECTION_STRING" in env
    (tmp_path / "run").mkdir()
    assert run_page("docs/page.md", blocks, tmp_path / "run", env, root) is None
    assert "[1]" in (tmp_path / "run" / "output.log").read_text().splitlines()


def test_what_a_fragment_calls_on_ckptvault_must_exist(tmp_path: Path):
    page = (
        '# Drift\n\n```python title="fragment"\n'
        "from ckptvault.integrations.nowhere import Trainer\n"
        'mgr = cv.CheckpointManager("runs/r", run_idd="r", retention=cv.Retention(keep_lats=2))\n'
        'mgr.save(step, state)\nreader = cv.dcp.StorageReeder("runs/r", run_id="r")\n```\n'
    )
    root = _site(tmp_path, page)
    problems = list(checked(blocks_of(root / "docs" / "page.md", root), root))
    assert [p.split(": ", 1)[1] for p in problems] == [
        "ckptvault has no cv.dcp.StorageReeder",
        "cv.CheckpointManager() takes no run_idd",
        "cv.Retention() takes no keep_lats",
        "no module ckptvault.integrations.nowhere",
    ], problems
