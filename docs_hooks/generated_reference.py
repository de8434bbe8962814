"""mkdocs hook: the reference pages generated from the code at build time, so they
cannot drift from it.

Contract: a page holds a marker comment on a line of its own; at build time the
marker is replaced by markdown generated from the code that the build imports:

- ``<!-- generated: cli -->``: every ``ckptvault`` command, its arguments, options
  and exit statuses, from the typer app (:mod:`reference_cli`);
- ``<!-- generated: errors -->``: the error classes of ``ckptvault.errors``, their
  hierarchy and exit statuses, and the restore checks' reason codes
  (:mod:`reference_errors`).

The Python API page needs no marker: mkdocstrings renders it from the docstrings
(``docs/reference/api.md``), through the griffe extension :mod:`griffe_roles`, which
this hook imports so that mkdocstrings finds it by name from any working directory.

A marker the hook does not know fails the build, so a typo cannot leave a page
silently empty. The generators are plain functions of no arguments, which tests call
without building the site.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import griffe_roles  # noqa: F401  # mkdocs.yml names it: mkdocstrings finds it loaded
from reference_cli import cli_markdown
from reference_errors import errors_markdown

GENERATORS: dict[str, Callable[[], str]] = {"cli": cli_markdown, "errors": errors_markdown}
MARKER = re.compile(r"^<!-- generated: (?P<name>[\w-]+) -->$", re.MULTILINE)


def generate(markdown: str) -> str:
    """``markdown`` with each marker replaced by its generated text."""

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in GENERATORS:
            raise ValueError(
                f"unknown marker <!-- generated: {name} -->; known: {sorted(GENERATORS)}"
            )
        return GENERATORS[name]()

    return MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return generate(markdown)
