"""The documentation's sections, found by heading wherever they live.

The old README's sections moved into the site's pages (``docs/**/*.md``), and the
README keeps a few of its own. A test that checks a documented example or table
names the section's heading; this module finds it in ``README.md`` or any page
under ``docs/``, so the test keeps reading the text users read wherever it moves.

A heading is matched by its title, whatever its level (``"### Save policies"`` and
``"Save policies"`` name the same section, which now sits at ``##`` on the saving
page), and must be unique across the README and the pages: a test cannot say which
of two sections it means. Headings inside fenced code (a ``# comment`` in a shell
block) are not headings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from markdown.extensions.toc import slugify

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"

_HEADING = re.compile(r"^(?P<hashes>#{1,6})\s+(?P<title>.+?)\s*$")
_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
# A python block, with or without fence attributes (```python title="fragment").
_PYTHON_BLOCK = re.compile(r"^```python(?:[ \t][^\n]*)?\n(.*?)^```", re.S | re.M)
_ANY_BLOCK = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.S | re.M)


@dataclass(frozen=True)
class Section:
    """One heading of one page: ``text`` is the page from that heading line on,
    ``body`` the section itself (up to the next heading of its level or above)."""

    page: Path
    level: int
    title: str
    text: str
    body: str

    @property
    def where(self) -> str:
        """The page, relative to the repository (``docs/guides/saving.md``)."""
        return str(self.page.relative_to(REPO))


def doc_pages() -> list[Path]:
    """``README.md`` and every Markdown page of the site, in a fixed order."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def _headings(text: str) -> list[tuple[int, int, str]]:
    """``(offset, level, title)`` of each heading outside fenced code."""
    found, offset, fence = [], 0, None
    for line in text.splitlines(keepends=True):
        opening = _FENCE.match(line)
        if opening is not None:
            marker = opening.group(1)
            if fence is None:
                fence = marker
            elif marker.startswith(fence):
                fence = None
        elif fence is None and (match := _HEADING.match(line)) is not None:
            found.append((offset, len(match["hashes"]), match["title"]))
        offset += len(line)
    return found


def _sections(page: Path) -> list[Section]:
    text = page.read_text()
    headings = _headings(text)
    sections = []
    for i, (offset, level, title) in enumerate(headings):
        end = next((o for o, lv, _ in headings[i + 1 :] if lv <= level), len(text))
        body = text[offset:end].split("\n", 1)[1] if "\n" in text[offset:end] else ""
        sections.append(Section(page, level, title, text[offset:], body))
    return sections


def section(heading: str) -> Section:
    """The one section titled ``heading`` (leading ``#``s ignored) in the README or
    the site's pages; an AssertionError says where it is missing or repeated."""
    title = heading.lstrip("#").strip()
    found = [s for page in doc_pages() for s in _sections(page) if s.title == title]
    where = ", ".join(s.where for s in found)
    assert found, f"no heading {title!r} in README.md or docs/**/*.md"
    assert len(found) == 1, f"heading {title!r} is in {where}: a test reads it, keep it unique"
    return found[0]


def python_block_after(heading: str) -> str:
    """The first ```python block after ``heading``, on its page."""
    match = _PYTHON_BLOCK.search(section(heading).text)
    assert match is not None, f"no python block after {heading!r}"
    return match.group(1)


def shell_block_after(heading: str, marker: str) -> str:
    """The first plain ``` block holding ``marker`` after ``heading``, on its page."""
    for language, block in _ANY_BLOCK.findall(section(heading).text):
        if not language and marker in block:
            return block
    raise AssertionError(f"no shell block with {marker!r} after {heading!r}")


def line_containing(snippet: str) -> str:
    """The one line of the README or the site's pages that holds ``snippet``."""
    lines = [ln for page in doc_pages() for ln in page.read_text().splitlines() if snippet in ln]
    assert len(lines) == 1, f"{snippet!r} is on {len(lines)} lines of the docs, not one"
    return lines[0]


def anchors(page: Path) -> set[str]:
    """The ids the site gives ``page``'s headings (mkdocs' toc slugs; a repeated
    title's later ids, ``_1``..., are left out)."""
    return {slugify(title, "-") for _, _, title in _headings(page.read_text())}
