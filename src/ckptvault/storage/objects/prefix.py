"""The prefix of an object store URL (``s3://bucket/<prefix>``, ``az://container/<prefix>``).

Split into plain components (letters, digits, ``.``, ``_``, ``-``, ``=``; never ``.``
or ``..``, nothing hidden, no empty component), so that every key a store builds
under it stays inside it.
"""

from __future__ import annotations

import re

from ckptvault.errors import UsageError

_PREFIX_PART_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._=-]{0,127}\Z")


def parse_prefix(url: str, path: str) -> str:
    """``path`` (a URL's path) as a key prefix: ``""`` or ``"a/b/"``; ``UsageError``
    naming ``url`` for a component that is not a plain name."""
    stripped = path.strip("/")
    components = stripped.split("/") if stripped else []
    for component in components:
        if not _PREFIX_PART_RE.match(component) or component in (".", ".."):
            raise UsageError(
                f"{url}: prefix component {component!r} is not a plain name (letters, digits, "
                "'.', '_', '-', '='; not hidden, not empty)"
            )
    return "/".join(components) + "/" if components else ""
