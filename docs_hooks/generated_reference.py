"""mkdocs hook: the reference pages generated from the code at build time, so they
cannot drift from it (the CLI from the typer app, the errors from ckptvault.errors).

Filled in by the reference work; until then it changes nothing.
"""

from __future__ import annotations

from typing import Any


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return markdown
