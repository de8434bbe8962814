"""The Python blocks of the README and the documentation site, and their markers.

Every ```python block in ``README.md`` and ``docs/**/*.md`` either runs (in
``tests/docs/test_doc_blocks.py``: a page's blocks in order, in one fresh process) or
carries a marker visible in the Markdown source that says why it does not:

- ```python title="fragment"  -- a fragment: it uses names it does not define
  (``model``, ``state``, ``mgr``...). The site shows "fragment" as the block's title.
- ```python { data-tested-by="tests/integration/test_x.py" }  -- run by that test,
  which must exist and name the block's heading (or quote one of its lines).

Whatever its marker, what a block calls on ``cv`` (attribute paths, keyword
arguments, ``ckptvault.*`` modules) must exist in ckptvault, so fragments, which never
run, cannot drift from the API unnoticed.

Both markers are fence attributes pymdownx.superfences renders as Python (an unknown word
after ``python``, such as ```python fragment, would turn the block into a plain
paragraph on the site), and GitHub takes the first word, ``python``, as the language.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from support import forkserver

REPO = Path(__file__).resolve().parents[2]
PAGE_TIMEOUT_S = 240  # a whole page's blocks, under a loaded make test

RUN, FRAGMENT, TESTED_ELSEWHERE = "run", "fragment", "tested-by"
FRAGMENT_INFO = 'python title="fragment"'
_TESTED_BY = re.compile(r'^python \{ data-tested-by="(?P<path>[^"]+)" \}$')
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_S3_URL = re.compile(r"""["']s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])/""")
_AZ_URL = re.compile(r"""["']az://([a-z0-9](?:[a-z0-9-]{1,61}[a-z0-9])?)/""")
_STRING = re.compile(r""""([^"\n]+)"|'([^'\n]+)'""")
_HEADING = re.compile(r"^#{1,6}\s+(?P<text>.+?)\s*#*\s*$")


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, what it says and what its marker asks."""

    page: str  # relative to the repository: README.md, docs/guides/saving.md
    number: int  # 1-based, among the page's python blocks
    line: int  # 1-based line of the opening fence
    heading: str  # the nearest heading above it, without its #s
    info: str  # the fence's info string, stripped
    code: str  # dedented as the fence was indented
    first_in_section: bool = True  # no python block between its heading and it

    @property
    def kind(self) -> str | None:
        """RUN, FRAGMENT or TESTED_ELSEWHERE; None for an info string no marker matches."""
        if self.info == "python":
            return RUN
        if self.info == FRAGMENT_INFO:
            return FRAGMENT
        if _TESTED_BY.match(self.info):
            return TESTED_ELSEWHERE
        return None

    @property
    def tested_by(self) -> str | None:
        match = _TESTED_BY.match(self.info)
        return match.group("path") if match else None

    def where(self) -> str:
        return f"{self.page}, block {self.number} (line {self.line}, under {self.heading!r})"


def pages(root: Path = REPO) -> list[Path]:
    """The README and every page of the site, in a stable order."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def blocks_of(page: Path, root: Path = REPO) -> list[Block]:
    """The page's python blocks (``python`` or ``py`` as the info string's first word)."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    heading, heading_line, index = "", 0, 0
    while index < len(lines):
        fence = _FENCE.match(lines[index])
        if fence is None:
            title = _HEADING.match(lines[index])
            if title:
                heading, heading_line = title.group("text"), index + 1
            index += 1
            continue
        opening, close = index, _closing(lines, index, fence.group("fence"))
        info = fence.group("info").strip()
        if info.split(" ", 1)[0].split("{", 1)[0] in ("python", "py"):
            body = "\n".join(lines[opening + 1 : close])
            found.append(
                Block(
                    page=str(page.relative_to(root)),
                    number=len(found) + 1,
                    line=opening + 1,
                    heading=heading,
                    info=info,
                    code=textwrap.dedent(body) + "\n",
                    first_in_section=not found or found[-1].line < heading_line,
                )
            )
        index = close + 1
    return found


def _closing(lines: list[str], opening: int, fence: str) -> int:
    """The line closing the fence opened at ``opening`` (CommonMark: the same character,
    at least as long, nothing after it); the end of the page if none does."""
    for index in range(opening + 1, len(lines)):
        stripped = lines[index].strip()
        if stripped.startswith(fence) and set(stripped) == {fence[0]}:
            return index
    return len(lines)


def marker_problems(block: Block, defined_before: set[str], root: Path = REPO) -> list[str]:
    """What is wrong with the block's marker (nothing for a block that runs):
    an unknown info string, a fragment that is not one, a tested-by naming no test."""
    kind = block.kind
    if kind is None:
        return [
            f"{block.where()}: fence info {block.info!r} is no marker this runner knows: "
            f"use ```python (it runs), ```{FRAGMENT_INFO} or "
            '```python { data-tested-by="tests/..." }'
        ]
    if kind == FRAGMENT:
        return _fragment_problems(block, defined_before)
    if kind == TESTED_ELSEWHERE:
        return _tested_by_problems(block, root)
    return []


def _fragment_problems(block: Block, defined_before: set[str]) -> list[str]:
    try:
        tree = ast.parse(block.code)
    except SyntaxError as error:
        return [f"{block.where()}: a fragment must still be Python: {error}"]
    if not free_names(tree) - defined_before:
        return [
            f"{block.where()}: marked a fragment, but it defines every name it uses "
            "(with the page's earlier blocks): let it run (```python), or say in a "
            "test that runs it (data-tested-by)"
        ]
    return []


def _tested_by_problems(block: Block, root: Path) -> list[str]:
    path = block.tested_by
    assert path is not None
    target = (root / path).resolve()
    if not target.is_relative_to(root / "tests") or not target.is_file():
        return [f"{block.where()}: data-tested-by names {path!r}, no file under tests/"]
    text = target.read_text()
    if _quotes_a_line(text, block.code):
        return []
    if not _names_heading(text, block.heading):
        return [
            f"{block.where()}: {path} names neither the heading {block.heading!r} "
            "nor a line of the block: is it the test that runs this block?"
        ]
    if not block.first_in_section:
        return [
            f"{block.where()}: {path} finds it by its heading, which finds the first "
            "python block after it, not this one: give this block a heading of its own"
        ]
    return []


def _names_heading(text: str, heading: str) -> bool:
    """The test's text holds the heading, or a string naming it by its start
    (``"#### A writer process"`` for 'A writer process: `async_mode="process"`')."""
    if heading in text:
        return True
    literals = (a or b for a, b in _STRING.findall(text))
    return any(len(name) >= 6 and heading.startswith(name) for name in map(_title, literals))


def _title(literal: str) -> str:
    return literal.lstrip("#").strip()


def _quotes_a_line(text: str, code: str) -> bool:
    """The test's text holds one of the block's lines, or a string of 20 characters or
    more found in one (not a comment): a test that runs one line of a block finds it
    by what it says."""
    lines = [ln.strip() for ln in code.splitlines() if not ln.strip().startswith("#")]
    if any(len(ln) >= 20 and ln in text for ln in lines):
        return True
    literals = [a or b for a, b in _STRING.findall(text)]
    return any(len(s) >= 20 and any(s in ln for ln in lines) for s in literals)


def api_problems(block: Block) -> list[str]:
    """What the block calls on ``cv`` (the house's name for ckptvault) that ckptvault
    does not have: an attribute path (``cv.dcp.StorageWriter``, ``cv.errors.X``), a
    keyword argument of a call (``CheckpointManager``'s are its ``ManagerOptions``),
    a ``ckptvault.*`` module imported. Fragments never run, so this is what keeps
    them from drifting from the API."""
    try:
        tree = ast.parse(block.code)
    except SyntaxError:
        return []  # a runnable block's run reports it; a fragment's check does
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (path := _cv_path(node)):
            problems += (
                [f"{block.where()}: ckptvault has no {path}"] if _resolve(path) is _MISSING else []
            )
        elif isinstance(node, ast.Call) and (path := _cv_path(node.func)):
            target = _resolve(path)
            given = {k.arg for k in node.keywords if k.arg is not None}
            unknown = sorted(given - _keywords(target, given))
            if unknown and target is not _MISSING:
                problems.append(f"{block.where()}: {path}() takes no {', '.join(unknown)}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = (
                [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            )
            for module in modules:
                if module and module.split(".")[0] == "ckptvault" and not _module_exists(module):
                    problems.append(f"{block.where()}: no module {module}")
    return sorted(set(problems))


_MISSING = object()


def _cv_path(node: ast.expr) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id == "cv" and parts:
        return "cv." + ".".join(reversed(parts))
    return None


def _resolve(path: str) -> object:
    import ckptvault

    target: object = ckptvault
    for name in path.split(".")[1:]:
        target = getattr(target, name, _MISSING)
        if target is _MISSING:
            break
    return target


def _keywords(target: object, given: set[str]) -> set[str]:
    """The keyword arguments ``target`` accepts (all of ``given`` when unknowable)."""
    from ckptvault.assembly import ManagerOptions
    from ckptvault.manager import CheckpointManager

    if target is CheckpointManager:
        return set(ManagerOptions.__annotations__)
    try:
        parameters = inspect.signature(target).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return given
    if any(p.kind is p.VAR_KEYWORD for p in parameters):
        return given
    return {p.name for p in parameters}


def _module_exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def free_names(tree: ast.AST) -> set[str]:
    """Names the code reads and binds nowhere (builtins aside): what it needs from
    outside. Scopes are flattened, which errs toward finding fewer free names."""
    read: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            read.add(node.id)
    return read - bound_names(tree) - set(dir(builtins))


def bound_names(tree: ast.AST) -> set[str]:
    """Every name the code binds anywhere: assignments, imports, definitions,
    arguments, loop, with and except targets."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bound.update(node.names)
    return bound


def checked(blocks: Iterable[Block], root: Path = REPO) -> Iterator[str]:
    """Every problem of a page's blocks, in order: their markers (a fragment must not
    use only what the page's earlier runnable blocks define: they run before it, like a
    notebook) and what they call on ckptvault that does not exist."""
    defined: set[str] = set()
    for block in blocks:
        yield from marker_problems(block, defined, root)
        yield from api_problems(block)
        if block.kind == RUN:
            with contextlib.suppress(SyntaxError):  # the run reports it
                defined |= bound_names(ast.parse(block.code))


def run_page(
    page: str, blocks: list[Block], tmp_path: Path, env: dict[str, str], root: Path = REPO
) -> str | None:
    """Run the blocks in one forked process; None, or what failed where."""
    work = tmp_path / "work"
    work.mkdir()
    spec = {
        "page": page,
        "path": str(root / page),
        "cwd": str(work),
        "result": str(tmp_path / "result.json"),
        "blocks": [{"number": b.number, "line": b.line, "code": b.code} for b in blocks],
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    log = tmp_path / "output.log"
    runner = Path(__file__).with_name("doc_block_runner.py")
    child = forkserver.server().start(runner, [str(tmp_path / "spec.json")], env, log)
    try:
        status = child.wait(PAGE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait(30)
        return f"{page}: timed out after {PAGE_TIMEOUT_S} s; output ends:\n{_tail(log)}"
    if status == 0:
        return None
    result = tmp_path / "result.json"
    if not result.exists():
        return f"{page}: the process exited {status}; output ends:\n{_tail(log)}"
    failed = json.loads(result.read_text())
    block = next(b for b in blocks if b.number == failed["number"])
    return f"{block.where()} failed: {failed['error']}\n{_tail(log)}"


def _tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def servers_for(blocks: list[Block], request: pytest.FixtureRequest) -> dict[str, str]:
    """The environment of the suite's storage servers the blocks' URLs need, with the
    buckets and containers they name created."""
    code = "".join(b.code for b in blocks)
    env: dict[str, str] = {}
    buckets, containers = set(_S3_URL.findall(code)), set(_AZ_URL.findall(code))
    if buckets:
        from support.s3_server import s3_client

        client = s3_client(request.getfixturevalue("s3_endpoint"))
        for bucket in buckets:
            with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
                client.create_bucket(Bucket=bucket)
        env.update({k: os.environ[k] for k in os.environ if k.startswith("AWS_")})
    if containers:
        from azure.core.exceptions import ResourceExistsError

        from support.azurite_server import service_client

        conn = request.getfixturevalue("azure_env")
        for container in containers:
            with contextlib.suppress(ResourceExistsError):
                service_client(conn).create_container(container)
        env["AZURE_STORAGE_CONNECTION_STRING"] = conn
    return env
