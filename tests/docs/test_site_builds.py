"""The documentation site builds with ``mkdocs build --strict``: no broken link, no
missing page, no reference the API pages cannot resolve (mkdocstrings reads the
docstrings of ``src/``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from support.common import REPO


def test_the_site_builds_strictly(tmp_path: Path):
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "index.html").is_file()
    assert (tmp_path / "reference" / "cli" / "index.html").is_file()
    # The reference pages generated from the code (tests/docs/test_reference_pages.py
    # checks what they say): the hook ran, mkdocstrings rendered the API.
    reference = tmp_path / "reference"
    assert "ckptvault verify [OPTIONS]" in (reference / "cli" / "index.html").read_text()
    assert 'id="checkpointerror"' in (reference / "errors" / "index.html").read_text()
    assert 'id="ckptvault.CheckpointManager"' in (reference / "api" / "index.html").read_text()
