"""Markdown from what the code says: docstrings as paragraphs, text as table cells, and
module-level constants with the comments beside them.

Shared by the generated reference pages (:mod:`reference_cli`, :mod:`reference_errors`).
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType

from griffe_roles import rewrite

CODE_SPAN = re.compile(r"(``.+?``|`[^`]+`)")
SPECIAL = re.compile(r"([\\*_\[\]>|])")


def in_module(module: ModuleType) -> Callable[[str], str]:
    """A resolver of role targets: a name ``module`` defines, as its full path."""
    return lambda name: f"{module.__name__}.{name}" if hasattr(module, name) else name


def inline(text: str, resolve: Callable[[str], str] | None = None) -> str:
    """``text`` on one line as markdown: code spans kept, markdown's special
    characters outside them escaped (so ``<RUN>`` or ``a|b`` print as written), and
    reST's roles rewritten (:func:`griffe_roles.rewrite`, targets through ``resolve``)."""
    text = " ".join(rewrite(text, resolve).split())
    parts = re.split(r"(<autoref .*?</autoref>)", text)  # rewrite's links stay HTML
    return "".join(part if part.startswith("<autoref") else _escape(part) for part in parts)


def _escape(text: str) -> str:
    pieces = CODE_SPAN.split(text)
    return "".join(
        piece if index % 2 else SPECIAL.sub(r"\\\1", piece).replace("<", "&lt;")
        for index, piece in enumerate(pieces)
    )


def paragraphs(doc: str | None, resolve: Callable[[str], str] | None = None) -> str:
    """A docstring as markdown: each paragraph on one line; an indented block (a
    reST literal block, an example) as a code block."""
    blocks = re.split(r"\n\s*\n", inspect.cleandoc(doc or ""))
    out = []
    for block in blocks:
        if not block.strip():
            continue
        lines = block.splitlines()
        if all(line.startswith((" ", "\t")) for line in lines):
            out.append("```text\n" + textwrap.dedent(block) + "\n```")
        elif re.match(r"\s*(\d+\.|[-*]) ", lines[0]):  # a list: one item per line
            items = re.split(r"\n(?=\s*(?:\d+\.|[-*]) )", block)
            out.append("\n".join(_list_item(item, resolve) for item in items))
        else:
            out.append(inline(block, resolve))
    return "\n\n".join(out)


def _list_item(item: str, resolve: Callable[[str], str] | None) -> str:
    marker, _, rest = item.strip().partition(" ")
    return f"{marker} {inline(rest, resolve)}"


def cell(text: str) -> str:
    """``text`` for a markdown table cell (one line, ``|`` escaped)."""
    return inline(text) or " "


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table; the cells are markdown already (see :func:`cell`)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def int_constants(
    module: ModuleType, names: Sequence[str] | None = None
) -> list[tuple[str, int, str]]:
    """``(name, value, comment)`` for the module-level ``NAME = <int>`` assignments of
    ``module`` (only ``names``, in that order, when given). The comment is the one at
    the end of the line, else the ``#`` lines just above it."""
    return [(n, v, c) for n, v, c in _constants(module, names) if isinstance(v, int)]


def str_constants(module: ModuleType) -> list[tuple[str, str, str]]:
    """As :func:`int_constants`, for ``NAME = "<str>"``."""
    return [(n, v, c) for n, v, c in _constants(module, None) if isinstance(v, str)]


def _constants(module: ModuleType, names: Sequence[str] | None) -> list[tuple[str, object, str]]:
    source = inspect.getsource(module)
    lines = source.splitlines()
    found: dict[str, tuple[str, object, str]] = {}
    for node in ast.parse(source).body:
        if not (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and node.targets[0].id.isupper()
            and isinstance(node.value, ast.Constant)
        ):
            continue
        name = node.targets[0].id
        found[name] = (name, node.value.value, _comment(lines, node.lineno - 1))
    if names is None:
        return list(found.values())
    return [found[name] for name in names]


def _comment(lines: list[str], index: int) -> str:
    _, hash_mark, trailing = lines[index].partition("  #")
    if hash_mark:
        return trailing.strip()
    above: list[str] = []
    while index > 0 and lines[index - 1].lstrip().startswith("#"):
        index -= 1
        above.insert(0, lines[index].lstrip()[1:].strip())
    return " ".join(above)
