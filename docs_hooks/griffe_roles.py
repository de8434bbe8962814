"""griffe extension: ckptvault's reST-flavoured docstrings read as markdown.

The docstrings are prose with Sphinx markup; mkdocstrings renders markdown, where it
would show as written. Two constructs are rewritten, in every docstring of the
package, before mkdocstrings renders them:

- a role (``:class:`X```, ``:meth:`~a.b.c```) becomes ``X`` (``c``: ``~`` keeps the
  last part) in code, linked to its entry in the API reference when that entry exists
  (an *optional* autoref: a target the site does not document stays plain code, it
  is never a broken reference under ``--strict``);
- a paragraph ending in ``::`` (reST's "a literal block follows") ends in ``:``, and a
  line that is only ``::`` goes; the indented block after it is a code block in
  markdown too.

Nothing else changes: ````literals```` are code spans in both languages, and the
Google ``Args:`` sections are parsed by mkdocstrings (``docstring_style: google``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import griffe

ROLE = re.compile(
    r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const):`(?P<tilde>~?)(?P<target>[\w.]+)`"
)
LITERAL_MARKER = re.compile(r"(?m)^(?P<text>.*?\S)?::[ \t]*$")


def rewrite(text: str, resolve: Callable[[str], str] | None = None) -> str:
    """``text`` with roles and literal-block markers as markdown (see the module
    docstring); ``resolve`` turns a role's target into the full dotted path of what
    it names (default: taken as written)."""
    text = ROLE.sub(lambda match: _role(match, resolve or str), text)
    return LITERAL_MARKER.sub(lambda match: f"{match['text']}:" if match["text"] else "", text)


def _role(match: re.Match[str], resolve: Callable[[str], str]) -> str:
    target = match["target"].lstrip(".")
    shown = target.rsplit(".", 1)[-1] if match["tilde"] else target
    return f'<autoref optional identifier="{resolve(target)}"><code>{shown}</code></autoref>'


def in_scope(obj: griffe.Object) -> Callable[[str], str]:
    """A resolver of role targets as seen from ``obj`` (a name unknown there stays)."""

    def resolve(target: str) -> str:
        if target.startswith("ckptvault."):
            return target
        head, _, rest = target.partition(".")
        try:
            resolved = obj.resolve(head)
        except (griffe.NameResolutionError, AttributeError):
            return target
        return f"{resolved}.{rest}" if rest else resolved

    return resolve


def _objects(obj: griffe.Object) -> Any:
    yield obj
    for member in obj.members.values():
        if not member.is_alias:  # an import: its own module rewrites it
            yield from _objects(member)  # type: ignore[arg-type]


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring of a package once griffe has loaded all of it."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = rewrite(obj.docstring.value, in_scope(obj))
